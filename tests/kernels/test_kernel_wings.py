"""The wings of kernels/ (docs/ARCHITECTURE.md, "The wings of kernels"): the op families import
only the ground floor (formats, uva, interpreter, tiles) and the families their rule names, the
wing graph has no cycle, it stays within 5 floors and 25 arrows, and the architecture page's
table lists what each folder holds."""

from __future__ import annotations

import re

from tests.test_imports import ROOT, cycle_in, floor_of, imports_of, modules

# Each wing and the wings it may import besides itself. "ground" is kernels/*.py.
RULES: dict[str, set[str]] = {
    "ground": set(),
    "reference": {"ground"},
    "store": {"ground"},
    "swap": {"ground"},
    "select": {"ground"},
    "dense": {"ground"},
    "attention": {"ground", "store"},
    # The kit: the set of kernels a process launches, over every family and the references.
    "kit": {"ground", "attention", "dense", "reference", "select", "store", "swap"},
}


def _wing_of_module(name: str) -> str | None:
    parts = name.split(".")
    if parts[0] != "kernels":
        return None
    if len(parts) > 1 and parts[1] in RULES:
        return parts[1]
    # `from kernels import formats` names a ground module; `kernels` alone is the package.
    return "ground"


def _wing_of_path(rel_parts: tuple[str, ...]) -> str:
    return rel_parts[1] if len(rel_parts) > 2 else "ground"


def wing_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {w: set() for w in RULES}
    for path in modules("kernels"):
        rel = path.relative_to(ROOT).parts
        here = _wing_of_path(rel)
        for name in imports_of(path):
            there = _wing_of_module(name)
            if there is not None and there != here:
                graph[here].add(there)
    return graph


def test_every_kernel_module_is_in_a_wing() -> None:
    folders = {
        p.name for p in (ROOT / "kernels").iterdir() if p.is_dir() and p.name != "__pycache__"
    }
    assert folders == set(RULES) - {"ground"}


def test_kernel_wings_import_only_what_their_rule_allows() -> None:
    graph = wing_graph()
    assert graph["attention"] == {"ground", "store"}, "the parser lost attention's imports"
    assert {w: sorted(v - RULES[w]) for w, v in graph.items() if v - RULES[w]} == {}


def test_kernel_wings_have_no_cycle_and_stay_within_five_floors_and_25_arrows() -> None:
    graph = wing_graph()
    assert cycle_in(graph) == []
    assert max(floor_of(w, graph) for w in graph) <= 5
    assert sum(len(v) for v in graph.values()) <= 25


def test_the_floor_counter_counts() -> None:
    assert floor_of("a", {"a": {"b"}, "b": {"c"}, "c": set()}) == 3
    assert floor_of("a", {"a": set()}) == 1


def test_the_architecture_lists_the_kernel_wings() -> None:
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    section = doc.split("## The wings of kernels", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `kernels/(\w*)/?` \| ([\w, ]+) \| (\d+) \|", section, re.M)
    listed = {wing or "ground": (set(names.split(", ")), int(n)) for wing, names, n in rows}
    assert set(listed) == set(RULES)
    for wing in RULES:
        folder = "kernels" if wing == "ground" else f"kernels/{wing}"
        held = {p.stem for p in (ROOT / folder).glob("*.py") if p.stem != "__init__"}
        assert listed[wing] == (held, len(held)), wing
