"""The model: the DeepSeek-V3.2-shaped network (model), its weights, rope and presets, the decode
step's static buffers and CUDA graphs (graph), and `compute`, which puts model, KV backend and
decode graphs together for one KV mode."""
