"""The one lazy loader of a package's public names (PEP 562 `__getattr__`), used by
`engine_client` and `engine_client.client`: `import engine_client` must stay light (no torch,
no gRPC) while `engine_client.Engine` still works. Imports nothing of ours."""

from __future__ import annotations

import importlib


def lazy_attribute(package: str, table: dict[str, str], name: str) -> object:
    """`name` from the module `table` maps it to; a table entry that names the submodule itself
    (`"errors": "contract.errors"`) returns that module."""
    target = table.get(name)
    if target is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    module = importlib.import_module(target)
    return module if target.endswith("." + name) else getattr(module, name)
