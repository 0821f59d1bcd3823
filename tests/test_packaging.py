"""Our top-level import names (`proto`, `kernels`, ...) are generic, and other distributions own
some of them (proto-plus installs `proto`, Hugging Face's `kernels` installs `kernels`). Until
they move under one namespace (docs/DECISIONS.md, "Top-level import names"), an environment
where another distribution provides one of them fails here, loudly, instead of one package
silently shadowing the other."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
OUR_PACKAGES = ("proto", "kernels", "kv_service", "engine_client", "contract", "transport")
OUR_DISTRIBUTION = "hisparse-kv"
# A module only our package of that name has: the other `proto` and `kernels` lack these.
OUR_MARKERS = {"proto": "proto.kvcache.v1.kvcache_pb2", "kernels": "kernels.reference"}


def _normal(name: str) -> str:
    return name.lower().replace("_", "-")


def foreign_providers() -> dict[str, list[str]]:
    """{top-level name: [other distributions that install it]} for our top-level names."""
    provided = importlib.metadata.packages_distributions()
    found = {}
    for name in OUR_PACKAGES:
        others = sorted({d for d in provided.get(name, ()) if _normal(d) != OUR_DISTRIBUTION})
        if others:
            found[name] = others
    return found


def test_no_other_distribution_installs_our_top_level_names() -> None:
    clashes = foreign_providers()
    assert not clashes, (
        f"other installed distributions provide our top-level packages: {clashes}. One of them "
        "shadows the other; use a separate environment (docs/DECISIONS.md)"
    )


def installed_by_us(path: Path) -> bool:
    """True if `path` is a file of our installed (non-editable) distribution."""
    try:
        dist = importlib.metadata.distribution(OUR_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return False
    return any(Path(dist.locate_file(f)).resolve() == path for f in dist.files or ())


@pytest.mark.parametrize("name", OUR_PACKAGES)
def test_top_level_names_resolve_to_this_project(name: str) -> None:
    module = importlib.import_module(name)
    where = Path(module.__file__ or "").resolve()
    assert REPO_ROOT in where.parents or installed_by_us(where), (
        f"`{name}` is imported from {where}, neither from {REPO_ROOT} nor from the installed "
        f"{OUR_DISTRIBUTION}: another package of that name shadows ours"
    )
    if name in OUR_MARKERS:
        importlib.import_module(OUR_MARKERS[name])


def test_the_check_sees_a_colliding_distribution(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fake proto-plus and HF kernels on sys.path are reported; the check can fail."""
    for dist, top in (("proto_plus-1.29.0", "proto"), ("kernels-0.4.0", "kernels")):
        info = tmp_path / f"{dist}.dist-info"
        info.mkdir()
        name, version = dist.rsplit("-", 1)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        (info / "top_level.txt").write_text(f"{top}\n")
        (info / "RECORD").write_text(f"{top}/__init__.py,,\n")
    monkeypatch.setattr(sys, "path", [os.fspath(tmp_path), *sys.path])
    clashes = foreign_providers()
    assert clashes.get("proto") == ["proto_plus"] and clashes.get("kernels") == ["kernels"]
    assert "kv_service" not in clashes
