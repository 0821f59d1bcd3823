"""The docs name code that exists (issue 39): every `path.py`, `path.py:Name` (or `::Name`,
`Class.attr`) and dotted `package.module.Name` reference in docs/*.md and README.md resolves.
A path resolves when it names a file of the repository, either from the root or as the tail
of one path (`serve/factory.py` is `engine_client/serve/factory.py`), or a file the document's
table of moves maps it to (BENCHMARKS.md keeps its commands as they were run); a name resolves when
one of those files defines it as a class, a function, a module-level assignment, a class-body
field, or a `self.<attr>` set in a method. A file moved or a class renamed without its docs
fails here, naming the document and the reference."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
PACKAGES = ("contract", "transport", "kernels", "kv_service", "engine_client", "proto", "bench")
SKIP_DIRS = {".git", ".venv", "venv", "node_modules", "__pycache__", "build", "dist"}

# `dir/file.py`, optionally followed by `:Name`, `::Name` or `:Class.attr`. A glob (`*_pb2.py`)
# or a path inside a URL is not a reference to this repository's files.
PATH_REF = re.compile(
    r"(?<![\w/.*:-])((?:[\w.-]+/)*[\w-]+\.py)(?![\w/])(?:::?([A-Za-z_][\w]*(?:\.[A-Za-z_]\w*)*))?"
)
# A row of a table of moves, in a document that records commands as they were run
# (docs/BENCHMARKS.md): `old/path.py` | `new/path.py` or `-m package.module`.
MOVED_REF = re.compile(r"`((?:[\w.-]+/)*[\w-]+\.py)` \| `(?:-m )?([\w./]+)`")
# `Class.member` in backticks (a call's arguments may follow).
MEMBER_REF = re.compile(r"`([A-Z][A-Za-z0-9]*)\.([A-Za-z_]\w*)(?:\([^`]*\))?`")
# `package.module.Name` inside backticks, starting at one of our packages.
DOTTED_REF = re.compile(r"`((?:%s)(?:\.[A-Za-z_]\w*)+)`" % "|".join(PACKAGES))


@functools.cache
def repo_files() -> tuple[str, ...]:
    """Every .py file of the repository as a root-relative posix path."""
    found = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if not SKIP_DIRS.intersection(rel.parts):
            found.append(rel.as_posix())
    return tuple(sorted(found))


def files_for(ref: str) -> list[str]:
    """The repository files a path reference can mean: itself, or any file it is the tail of."""
    ref = ref.removeprefix("./")
    return [f for f in repo_files() if f == ref or f.endswith("/" + ref)]


@functools.cache
def definitions(rel: str) -> frozenset[str]:
    """Names a module defines: top-level classes, functions and assignments, and for each
    class `Class.member` for its methods, body fields and `self.<attr>` assignments."""
    tree = ast.parse((ROOT / rel).read_text(), filename=rel)
    names: set[str] = set()
    for node in tree.body:
        names.update(_bound_names(node))
        if isinstance(node, ast.ClassDef):
            names.update(f"{node.name}.{member}" for member in _class_members(node))
    return frozenset(names)


def _bound_names(node: ast.stmt) -> set[str]:
    if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        return {node.name}
    targets: list[ast.expr] = []
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        targets = [node.target]
    out: set[str] = set()
    for target in targets:
        for sub in ast.walk(target):
            if isinstance(sub, ast.Name):
                out.add(sub.id)
    if isinstance(node, (ast.If, ast.Try)):  # `if TYPE_CHECKING:` / try-import blocks
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.stmt):
                out.update(_bound_names(child))
    return out


def _class_members(cls: ast.ClassDef) -> set[str]:
    members: set[str] = set()
    for node in cls.body:
        members.update(_bound_names(node))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for sub in ast.walk(node):
                if (
                    isinstance(sub, ast.Attribute)
                    and isinstance(sub.ctx, ast.Store)
                    and isinstance(sub.value, ast.Name)
                    and sub.value.id == "self"
                ):
                    members.add(sub.attr)
    return members


def _name_in(files: list[str], name: str) -> bool:
    # `Class.method.attr` is deeper than we index; its first two parts must resolve.
    key = ".".join(name.split(".")[:2])
    return any(key in definitions(f) for f in files)


def moved_files(text: str) -> dict[str, list[str]]:
    """Old path -> the files its code is in now, from the document's table of moves (a module
    run with -m is its file, or its package's __main__.py)."""
    moved = {}
    for match in MOVED_REF.finditer(text):
        new = match.group(2)
        if not new.endswith(".py"):
            base = new.replace(".", "/")
            new = base + ".py" if _exists(base + ".py") else base + "/__main__.py"
        moved[match.group(1)] = files_for(new)
    return moved


def path_problems(text: str) -> list[str]:
    problems = []
    moved = moved_files(text)
    for match in PATH_REF.finditer(text):
        path, name = match.group(1), match.group(2)
        files = files_for(path) or moved.get(path, [])
        if not files:
            problems.append(f"{match.group(0)}: no file {path}")
        elif name and not _name_in(files, name):
            problems.append(f"{match.group(0)}: {path} defines no {name}")
    return problems


def dotted_problems(text: str) -> list[str]:
    problems = []
    for match in DOTTED_REF.finditer(text):
        parts = match.group(1).split(".")
        for cut in range(len(parts), 0, -1):  # the longest prefix that is a module
            base = "/".join(parts[:cut])
            module = next((m for m in (base + ".py", base + "/__init__.py") if _exists(m)), None)
            if module:
                rest = ".".join(parts[cut:])
                if rest and not _name_in([module], rest):
                    problems.append(f"{match.group(1)}: {module} defines no {rest}")
                break
        else:
            problems.append(f"{match.group(1)}: no module")
    return problems


@functools.cache
def package_classes() -> dict[str, list[tuple[str, ...]]]:
    """Every class of our packages by name: its members and its base classes' names."""
    found: dict[str, list[tuple[str, ...]]] = {}
    for rel in repo_files():
        if rel.split("/")[0] not in PACKAGES or rel.endswith("_pb2.py"):
            continue
        tree = ast.parse((ROOT / rel).read_text(), filename=rel)
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                bases = tuple(ast.unparse(b).split(".")[-1] for b in node.bases)
                members = tuple(sorted(_class_members(node)))
                found.setdefault(node.name, []).append(members + ("|",) + bases)
    return found


def _has_member(cls: str, member: str, seen: frozenset[str] = frozenset()) -> bool:
    for entry in package_classes().get(cls, []):
        cut = entry.index("|")
        if member in entry[:cut]:
            return True
        if any(_has_member(b, member, seen | {cls}) for b in entry[cut + 1 :] if b not in seen):
            return True
    return False


def member_problems(text: str) -> list[str]:
    """`Class.member` in backticks, where Class is one of ours: the class (or a base) has it."""
    problems = []
    for match in MEMBER_REF.finditer(text):
        cls, member = match.group(1), match.group(2)
        if cls in package_classes() and not _has_member(cls, member):
            problems.append(f"{cls}.{member}: no class {cls} has {member}")
    return problems


def table_problems(text: str) -> list[str]:
    """A table row whose cell is one `path.py`: the classes it names in later cells live there."""
    problems = []
    for line in text.splitlines():
        cells = (
            [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        )
        for i, cell in enumerate(cells):
            path = re.fullmatch(r"`((?:[\w.-]+/)*[\w-]+\.py)`", cell)
            files = files_for(path.group(1)) if path else []
            for later in cells[i + 1 :] if files else []:
                for name in re.findall(r"`([A-Z][A-Za-z0-9]+)`", later):
                    if not _name_in(files, name):
                        problems.append(f"{path.group(1)} row: {name} is not defined there")
    return problems


def _exists(rel: str) -> bool:
    return rel in repo_files()


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_doc_references_resolve(doc: Path) -> None:
    text = doc.read_text()
    problems = (
        path_problems(text) + dotted_problems(text) + member_problems(text) + table_problems(text)
    )
    assert not problems, f"{doc.name}: stale references:\n  " + "\n  ".join(problems)


def test_the_checker_catches_a_stale_reference() -> None:
    """The resolver is not vacuous: a moved file, a missing name and a wrong module fail."""
    assert path_problems("`contract/errors.py:NoSuchThing`")
    assert path_problems("`nowhere/missing.py`")
    assert dotted_problems("`contract.errors.NoSuchThing`")
    assert member_problems("`KVClient.no_such_call`")
    assert table_problems("| run | `loop/scheduler.py` | `NoSuchClass` |")
    assert not member_problems("`KVClient.release`")
    assert not path_problems("`serve/factory.py:build_engine`")
    assert not dotted_problems("`contract.errors`")


def test_a_table_of_moves_resolves_old_paths_to_files_that_exist() -> None:
    text = (
        "| old | now |\n|---|---|\n| `bench/e2e.py` | `-m bench.e2e` |\n"
        "| `bench/gone.py` | `-m bench.nothing` |\n"
        "ran `bench/e2e.py`, `bench/gone.py` and `bench/never.py`\n"
    )
    assert path_problems(text) == [
        "bench/gone.py: no file bench/gone.py",
        "bench/gone.py: no file bench/gone.py",
        "bench/never.py: no file bench/never.py",
    ]
