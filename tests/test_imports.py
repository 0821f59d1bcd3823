"""The one direction of imports between the parts and the wings (docs/ARCHITECTURE.md):
contract <- kv_service, contract <- engine_client.client <- the engine's other wings, which
import only downward (cli -> serve -> loop -> model -> kv -> client; the gateway beside serve,
on client alone) and touch kv_service in one place (the embedded mode's factory); no import
cycle anywhere; the wings hold the modules the architecture page lists. bench/ stands outside
the package: it may import the package, the package never imports it; its families import
bench.shared and not each other, except a family built on another (BENCH_BUILT_ON). Imports
are read with `ast`, function-level ones included, so a lazy import counts too."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EMBEDDED_FACTORY = "engine_client/serve/factory.py"  # the only engine module that may build a core
# The wings of engine_client, top floor first: each imports only the ones after it. The gateway
# sits beside serve (it imports only client: test_gateway_is_a_plain_client_of_the_engine).
WINGS = ("cli", "gateway", "serve", "loop", "model", "kv", "text", "client")
# Our packages: the whole import graph (tests aside).
PACKAGES = ("contract", "transport", "kernels", "kv_service", "engine_client", "proto", "bench")
# The families of bench/ (each `python -m bench.<family>`) and the other families each is built
# on: prefix and mtp size and drive their runs with e2e's plan, load and children. Every family
# may import bench.shared; bench.shared imports no family.
BENCH_BUILT_ON: dict[str, set[str]] = {
    "e2e": set(),
    "prefix": {"e2e"},
    "mtp": {"e2e"},
    "gateway": set(),
    "kernels": set(),
    "profile": set(),
    "bookkeeping": set(),
    "sanitize": set(),
    "disagg": set(),
}
# The rooms of kv_service (a wing folder or a root module) and the rooms each may import.
SERVICE_ROOMS: dict[str, set[str]] = {
    "__main__": {"rpc", "config"},
    "rpc": {"core", "books", "memory", "config"},
    "core": {"books", "memory"},
    "books": set(),
    "memory": set(),
    "config": set(),
}


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


def test_contract_holds_no_transport_code() -> None:
    assert (
        _offenders("contract", {"grpc", "grpc_health", "grpc_reflection", "prometheus_client"})
        == {}
    )


def test_transport_imports_neither_side() -> None:
    """The gRPC scaffold and call handling both servers share (docs/DECISIONS.md)."""
    assert _offenders("transport", {"kv_service", "engine_client", "kernels"}) == {}


def test_kernels_import_neither_side() -> None:
    assert _offenders("kernels", {"kv_service", "engine_client", "contract"}) == {}


def _defines_triton_kernels(path: Path) -> bool:
    tree = ast.parse(path.read_text(), filename=str(path))
    return any(
        isinstance(node, ast.Attribute) and node.attr == "jit" and ast.unparse(node) == "triton.jit"
        for node in ast.walk(tree)
    )


def test_every_kernel_module_sets_the_interpreter_switch() -> None:
    """kernels/__init__.py imports nothing heavy (kernels.formats is read without torch), so the
    module that sets TRITON_INTERPRET without CUDA must be imported by each Triton module."""
    with_jit = [p for p in modules("kernels") if _defines_triton_kernels(p)]
    assert len(with_jit) >= 7, "the parser lost the kernels"
    missing = [_rel(p) for p in with_jit if "kernels.interpreter" not in imports_of(p)]
    assert missing == []


def _wing(name: str) -> str | None:
    """The wing of a module name (engine_client.<wing>...), else None."""
    parts = name.split(".")
    return (
        parts[1] if parts[0] == "engine_client" and len(parts) > 1 and parts[1] in WINGS else None
    )


def test_wings_import_only_downward() -> None:
    assert {p.name for p in (ROOT / "engine_client").iterdir() if p.is_dir()} >= set(WINGS)
    upward = {}
    for wing in WINGS:
        for path in modules(f"engine_client/{wing}"):
            up = sorted(
                n
                for n in imports_of(path)
                if (w := _wing(n)) and WINGS.index(w) < WINGS.index(wing)
            )
            if up:
                upward[_rel(path)] = up
    assert upward == {}


def test_client_library_imports_only_the_contract_and_proto() -> None:
    """The library an engine adopts: no service, no kernels, no other wing of ours."""
    assert modules("engine_client/client"), "the client library moved: update this test"
    ours = {"contract", "kernels", "kv_service", "engine_client", "proto", "bench"}
    allowed = ("contract", "proto", "engine_client.client")
    bad = {}
    for path in modules("engine_client/client"):
        names = [n for n in imports_of(path) if _top(n) in ours and not n.startswith(allowed)]
        names = [n for n in names if n != "engine_client"]
        if names:
            bad[_rel(path)] = sorted(names)
    assert bad == {}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (an imported name resolves to its longest
    prefix that is a module: `from a.b import C` is an edge to a.b)."""
    paths = {_module_name(p): p for pkg in PACKAGES for p in modules(pkg)}

    def resolve(name: str) -> str | None:
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    return {
        m: {r for n in imports_of(p) if (r := resolve(n)) is not None and r != m}
        for m, p in paths.items()
    }


def cycle_in(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of `graph` (its modules, the first repeated at the end), or []."""
    done: set[str] = set()
    for start in sorted(graph):
        path: list[str] = []
        todo = [(start, iter(sorted(graph[start])))]
        on_path = {start}
        path.append(start)
        while todo:
            node, nexts = todo[-1]
            nxt = next(nexts, None)
            if nxt is None:
                todo.pop()
                on_path.discard(path.pop())
                done.add(node)
            elif nxt in on_path:
                return path[path.index(nxt) :] + [nxt]
            elif nxt not in done:
                todo.append((nxt, iter(sorted(graph[nxt]))))
                on_path.add(nxt)
                path.append(nxt)
    return []


def test_the_import_graph_has_no_cycle() -> None:
    graph = import_graph()
    assert len(graph) > 100 and "engine_client.loop.engine" in graph
    assert "engine_client.model.compute" in graph["engine_client.loop.engine"]
    assert cycle_in(graph) == []


def test_the_cycle_finder_finds_cycles() -> None:
    assert cycle_in({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert cycle_in({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_the_wings_hold_the_modules_the_architecture_lists() -> None:
    """docs/ARCHITECTURE.md's wing table (modules and count) is what the folders hold."""
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    doc = doc.split("## The wings of engine_client", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)/` \| ([\w/, ]+) \| (\d+) \|", doc, re.M)
    listed = {wing: (set(names.split(", ")), int(count)) for wing, names, count in rows}
    assert set(listed) == set(WINGS)
    for wing in WINGS:
        # A module of a folder inside the wing is listed with its folder (settings/batching).
        home = ROOT / "engine_client" / wing
        held = {
            p.relative_to(home).with_suffix("").as_posix()
            for p in modules(f"engine_client/{wing}")
            if p.stem != "__init__"
        }
        assert listed[wing] == (held, len(held)), wing


def test_service_never_imports_the_engine_side() -> None:
    assert _offenders("kv_service", {"engine_client"}) == {}


def test_only_the_factory_imports_the_service_in_the_reference_engine() -> None:
    users = _offenders("engine_client", {"kv_service"})
    assert set(users) == {EMBEDDED_FACTORY}
    assert users[EMBEDDED_FACTORY] == [
        "kv_service.core",
        "kv_service.core.ServiceCore",
        "kv_service.memory.store",
        "kv_service.memory.store.allocate_local",
    ]


@pytest.mark.parametrize(
    "source, expected",
    [
        ("def f():\n    from kv_service import core\n", {"kv_service", "kv_service.core"}),
        (
            "import importlib\nimportlib.import_module('kv_service.core')\n",
            {"importlib", "kv_service.core"},
        ),
        (
            "class A:\n    def m(self):\n        import kv_service.books.pool as p\n",
            {"kv_service.books.pool"},
        ),
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


def test_gateway_is_a_plain_client_of_the_engine() -> None:
    """The gateway talks to the engine over gRPC only, as any client: it imports the client
    library (errors, addresses) and nothing of serve, the loop, the model or the KV code; only
    the CLI imports it, and the CLI composes it with the engine (`serve --http`)."""
    allowed = ("engine_client.gateway", "engine_client.client")
    assert _engine_imports("engine_client/gateway", allowed) == {}
    users = {
        _rel(p)
        for p in modules("engine_client")
        if any(n.startswith("engine_client.gateway") for n in imports_of(p))
        and not _rel(p).startswith(("engine_client/gateway/", "engine_client/cli/"))
    }
    assert users == set()


def _service_room(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if parts[0] == "kv_service" and len(parts) > 1 else None


def service_arrows() -> dict[str, set[str]]:
    """Room -> the other kv_service rooms its modules import."""
    arrows: dict[str, set[str]] = {room: set() for room in SERVICE_ROOMS}
    for path in modules("kv_service"):
        room = _service_room(_module_name(path))
        if room is None:
            continue
        arrows.setdefault(room, set()).update(
            r for n in imports_of(path) if (r := _service_room(n)) and r != room
        )
    return arrows


def test_service_rooms_import_only_what_their_rule_allows() -> None:
    arrows = service_arrows()
    assert set(arrows) == set(SERVICE_ROOMS), "a kv_service room has no declared rule"
    bad = {room: sorted(to - SERVICE_ROOMS[room]) for room, to in arrows.items()}
    assert {room: to for room, to in bad.items() if to} == {}


def floor_of(room: str, arrows: dict[str, set[str]]) -> int:
    """How many floors `room` stands on: 1 + the highest floor it imports (arrows acyclic)."""
    return 1 + max((floor_of(r, arrows) for r in arrows[room]), default=0)


def test_service_has_no_cycle_and_at_most_five_floors() -> None:
    arrows = service_arrows()
    assert cycle_in(arrows) == []
    assert max(floor_of(room, arrows) for room in arrows) <= 5


def test_service_wings_hold_the_modules_the_architecture_lists() -> None:
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    rows = re.findall(r"^\| `kv_service/(\w+)/` \| ([\w, ]+) \| (\d+) \|", doc, re.M)
    listed = {wing: (set(names.split(", ")), int(count)) for wing, names, count in rows}
    wings = {p.name for p in (ROOT / "kv_service").iterdir() if (p / "__init__.py").exists()}
    assert set(listed) == wings
    for wing in wings:
        held = {p.stem for p in modules(f"kv_service/{wing}") if p.stem != "__init__"}
        assert listed[wing] == (held, len(held)), wing


def test_the_package_never_imports_bench() -> None:
    """Benchmarks sit on top of the package; the engine names bench.shared.trace only as a
    string a flag passes (MODULE:FUNC), never as an import."""
    for package in [p for p in PACKAGES if p != "bench"]:
        assert _offenders(package, {"bench"}) == {}, package


def _bench_family(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if parts[0] == "bench" and len(parts) > 1 else None


def test_bench_families_import_the_shared_module_not_each_other() -> None:
    folders = {p.name for p in (ROOT / "bench").iterdir() if (p / "__init__.py").exists()}
    assert folders == set(BENCH_BUILT_ON) | {"shared"}, "a bench family has no declared rule"
    loose = {p.name for p in (ROOT / "bench").glob("*.py")}
    assert loose == {"__init__.py"}, "bench/ holds families, not modules"
    bad = {}
    for family in sorted(folders):
        allowed = {family} | BENCH_BUILT_ON.get(family, set()) | ({"shared"} - {family})
        if family == "shared":
            allowed = {"shared"}
        for path in modules(f"bench/{family}"):
            names = {f for n in imports_of(path) if (f := _bench_family(n)) is not None}
            if names - allowed:
                bad[_rel(path)] = sorted(names - allowed)
    assert bad == {}


def _lines_with(text: str, folders: tuple[str, ...]) -> list[str]:
    """'path:line' of each line of our modules under `folders` that contains `text`."""
    return [
        f"{_rel(path)}:{i}"
        for folder in folders
        for path in modules(folder)
        if not path.name.endswith(("_pb2.py", "_pb2_grpc.py"))  # generated by grpc_tools
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if text in line
    ]


def test_no_module_edits_sys_path_or_imports_late() -> None:
    """Benchmarks run as `python -m bench.<family>` from the repository root, so none puts the
    root on sys.path itself, and no import waits for such a line (`# noqa: E402`)."""
    assert _lines_with("sys.path.insert", ("bench",)) == []
    late = _lines_with("noqa: E402", (*PACKAGES, "tests"))
    # This test names the marker itself (its docstring and the line above): the search works.
    assert [line.split(":")[0] for line in late] == ["tests/test_imports.py"] * 2
