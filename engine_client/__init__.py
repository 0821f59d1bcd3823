"""The engine side, in two parts a newcomer can tell apart by folder:

- `engine_client/client/`: the client library an external engine adopts to use the KV service
  (`KVClient`, the `KVControl` protocol, typed errors). It imports `contract`, never `kv_service`.
  Documented in docs/CLIENT.md.
- the other wings: our reference DeepSeek-V3.2-shaped decode engine built on it, and its CLI
  `python -m engine_client {serve,generate,demo}`: `cli/` (commands), `serve/` (Decode gRPC
  server, factory, supervisor), `loop/` (engine, scheduler, runner, postprocess), `model/`
  (model, CUDA graphs, weights) and `kv/` (KV backends). docs/ARCHITECTURE.md maps them.

Public API, imported lazily so that `import engine_client` stays light (no torch, no gRPC):
- `KVClient`, `KVControl`, `KVLayout`, `errors`: from `engine_client.client`
- `Engine`, `build_engine`: the reference engine and its factory (torch-heavy)
- `ModelConfig`, `Model`, `random_weights`, `load_safetensors`, `save_safetensors`,
  `BaselineBackend`, `HiSparseBackend`, `RemoteSwapBackend`, `ModelRunner`, `KernelSet`:
  the compute side (see each module)
"""

from contract.grpc_fork import disable_grpc_fork_handlers
from engine_client.client.lazy_exports import lazy_attribute  # loads no gRPC

disable_grpc_fork_handlers()  # before any module of ours loads gRPC (see contract/grpc_fork.py)

_LAZY = {
    "KVClient": "engine_client.client",
    "KVControl": "engine_client.client",
    "KVLayout": "engine_client.client",
    "errors": "contract.errors",
    "Engine": "engine_client.loop.engine",
    "build_engine": "engine_client.serve.factory",
    # Not `preset`: importing the submodule engine_client.model.preset would shadow the function.
    "ModelConfig": "engine_client.model.preset",
    "random_weights": "engine_client.model.weights",
    "load_safetensors": "engine_client.model.weights",
    "save_safetensors": "engine_client.model.weights",
    "Model": "engine_client.model.model",
    "KVBackend": "engine_client.kv.backend",
    "BaselineBackend": "engine_client.kv.baseline",
    "HiSparseBackend": "engine_client.kv.hisparse",
    "RemoteSwapBackend": "engine_client.kv.remote_swap",
    "ModelRunner": "engine_client.model.model_runner",
    "DecodeConfig": "engine_client.model.model_runner",
    "KernelSet": "kernels.kit.kernel_set",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> object:
    return lazy_attribute(__name__, _LAZY, name)
