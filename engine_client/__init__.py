"""The engine side: the KV-service client library and a DeepSeek-V3.2-shaped decode engine.

Compute side (torch; imported lazily so the gRPC-only modules stay light):
- `preset.ModelConfig`, `preset.preset("tiny" | "bench" | "v32")`: model shapes
- `weights.random_weights`, `weights.load_safetensors`, `weights.save_safetensors`
- `model.Model`: forward and chunked prefill over a KV backend
- `kv_backend.BaselineBackend`, `hisparse_backend.HiSparseBackend`,
  `hisparse_backend.RemoteSwapBackend`: where KV lives (see each module)
- `graph.DecodeRunner`: the decode step on static buffers, CUDA graphs per batch bucket
- `kernel_set.KernelSet`: Triton kernels or their torch references
"""

import importlib

_LAZY = {
    # Not `preset`: importing the submodule engine_client.preset would shadow the function.
    "ModelConfig": "engine_client.preset",
    "random_weights": "engine_client.weights", "load_safetensors": "engine_client.weights",
    "save_safetensors": "engine_client.weights", "Model": "engine_client.model",
    "KVBackend": "engine_client.kv_backend", "BaselineBackend": "engine_client.kv_backend",
    "BaselineConfig": "engine_client.kv_backend", "HiSparseBackend": "engine_client.hisparse_backend",
    "RemoteSwapBackend": "engine_client.hisparse_backend", "DecodeRunner": "engine_client.graph",
    "DecodeConfig": "engine_client.graph", "KernelSet": "engine_client.kernel_set",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'engine_client' has no attribute {name!r}")
