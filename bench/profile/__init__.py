"""One decode step, every kernel charged to a family and a model part (`python -m
bench.profile`: breakdown, parts). Also copy_sweep (the step against the side-stream copy's
grid, built on breakdown) and graph_step (steps per second with and without CUDA graphs), each
`python -m bench.profile.<name>`."""
