"""The one direction of imports between the parts (docs/ARCHITECTURE.md):
contract <- kv_service, contract <- engine_client.client <- reference engine, and the reference
engine touches kv_service in one place only (the embedded mode's factory).
Imports are read with `ast`, function-level ones included, so a lazy import counts too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EMBEDDED_FACTORY = "engine_client/serve/factory.py"  # the only engine module that may build a core


def imports_of(path: Path) -> set[str]:
    """Every module name imported anywhere in the file (top level, functions, classes)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            # `from engine_client import errors` imports a submodule as a name.
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and _is_dynamic_import(node):
            found.add(node.args[0].value)
    return found


def _is_dynamic_import(node: ast.Call) -> bool:
    """importlib.import_module("x") / __import__("x") with a literal name."""
    f = node.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
    return (
        name in ("import_module", "__import__")
        and bool(node.args)
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    )


def _top(name: str) -> str:
    return name.split(".")[0]


def modules(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _offenders(
    folder: str, forbidden: set[str], skip: tuple[str, ...] = ()
) -> dict[str, list[str]]:
    out = {}
    for path in modules(folder):
        if _rel(path).startswith(skip) or _rel(path) in skip:
            continue
        bad = sorted(n for n in imports_of(path) if _top(n) in forbidden)
        if bad:
            out[_rel(path)] = bad
    return out


def test_contract_imports_neither_side() -> None:
    assert _offenders("contract", {"kv_service", "engine_client"}) == {}


def test_kernels_import_neither_side() -> None:
    assert _offenders("kernels", {"kv_service", "engine_client", "contract"}) == {}


def test_client_library_never_imports_the_service() -> None:
    assert modules("engine_client/client"), "the client library moved: update this test"
    assert _offenders("engine_client/client", {"kv_service"}) == {}


def test_client_library_never_imports_the_reference_engine() -> None:
    bad = {}
    for path in modules("engine_client/client"):
        names = [
            n
            for n in imports_of(path)
            if _top(n) == "engine_client" and not n.startswith("engine_client.client")
        ]
        if names:
            bad[_rel(path)] = sorted(names)
    assert bad == {}


def test_service_never_imports_the_engine_side() -> None:
    assert _offenders("kv_service", {"engine_client"}) == {}


def test_only_the_factory_imports_the_service_in_the_reference_engine() -> None:
    users = _offenders("engine_client", {"kv_service"})
    assert set(users) == {EMBEDDED_FACTORY}
    assert users[EMBEDDED_FACTORY] == [
        "kv_service.core",
        "kv_service.core.ServiceCore",
        "kv_service.memory",
        "kv_service.memory.allocate_local",
    ]


@pytest.mark.parametrize(
    "source, expected",
    [
        ("def f():\n    from kv_service import core\n", {"kv_service", "kv_service.core"}),
        (
            "import importlib\nimportlib.import_module('kv_service.core')\n",
            {"importlib", "kv_service.core"},
        ),
        ("class A:\n    def m(self):\n        import kv_service.pool as p\n", {"kv_service.pool"}),
        ("from . import sibling\n", set()),
    ],
)
def test_the_parser_sees_lazy_imports(tmp_path: Path, source: str, expected: set[str]) -> None:
    path = tmp_path / "m.py"
    path.write_text(source)
    assert imports_of(path) == expected


def _engine_imports(folder: str, allowed: tuple[str, ...]) -> dict[str, list[str]]:
    """engine_client modules that files under `folder` import outside the `allowed` prefixes."""
    bad = {}
    for path in modules(folder):
        names = [
            n
            for n in imports_of(path)
            if _top(n) == "engine_client" and not n.startswith(allowed) and n != "engine_client"
        ]
        if names:
            bad[_rel(path)] = sorted(names)
    return bad


def test_text_wing_imports_no_other_wing() -> None:
    """The vocabulary owner is a ground floor: the model's presets ask it for their size."""
    assert modules("engine_client/text"), "the text wing moved: update this test"
    assert _engine_imports("engine_client/text", ("engine_client.text",)) == {}


def test_gateway_is_a_decode_client_above_serve() -> None:
    """The gateway talks to the engine over gRPC only: the client library's errors, the serve
    wing's config and server (to run beside the engine), never the loop, model or KV code; and
    only the CLI imports the gateway."""
    allowed = ("engine_client.gateway", "engine_client.client", "engine_client.serve")
    assert _engine_imports("engine_client/gateway", allowed) == {}
    users = {
        _rel(p)
        for p in modules("engine_client")
        if any(n.startswith("engine_client.gateway") for n in imports_of(p))
        and not _rel(p).startswith(("engine_client/gateway/", "engine_client/cli/"))
    }
    assert users == set()
