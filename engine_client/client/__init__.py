"""The KV-service client library: what any decode engine adopts to keep its KV cache in a
`python -m kv_service` process. It imports the contract (`contract`), never the service.

- `KVClient`: attach (maps the service's KV tensors into this process), admit / commit /
  step_end / release over one Session stream, `remote_swap` in remote-swap mode, `let_go` /
  `reattach` after a lost service, `close`.
- `KVControl`, `Admission`, `PrefixLookup`, `HeldRequest`, `StepReport`, `KVStats`,
  `MemoryUser`: the control protocol and the records it exchanges (`control`).
- `page_hashes`: the names of a prompt's full pages for prefix caching (`contract.prefix`).
- `errors`: the typed errors every call raises: `contract.errors` itself, the one taxonomy
  (decoded from rich gRPC status in one place, `engine_client.client.status`).
- Contract types a caller needs: `KVLayout` (the layout descriptor), `KVTensors` (the mapped
  tensor set; its fields are what the kernels take).

docs/CLIENT.md documents the API with a runnable decode loop (`docs/client_example.py`).
"""

from contract import errors
from engine_client.client.lazy_exports import lazy_attribute

# Lazy, so that importing the package (light CLIs do) does not pull in torch or gRPC.
_LAZY = {
    "KVClient": "engine_client.client.kv_client",
    "Admission": "engine_client.client.control",
    "HeldRequest": "engine_client.client.control",
    "KVControl": "engine_client.client.control",
    "KVStats": "engine_client.client.control",
    "MemoryUser": "engine_client.client.control",
    "StepReport": "engine_client.client.control",
    "PrefixLookup": "engine_client.client.control",
    "page_hashes": "contract.prefix",
    "KVLayout": "contract.layout",
    "MODE_OFFLOADED": "contract.layout",
    "MODE_RESIDENT": "contract.layout",
    "KVTensors": "contract.tensors",
}

__all__ = [
    "MODE_OFFLOADED",
    "MODE_RESIDENT",
    "Admission",
    "HeldRequest",
    "KVClient",
    "KVControl",
    "KVLayout",
    "KVStats",
    "KVTensors",
    "MemoryUser",
    "PrefixLookup",
    "StepReport",
    "page_hashes",
    "errors",
]


def __getattr__(name: str) -> object:
    return lazy_attribute(__name__, _LAZY, name)
