"""The committed generated code matches the .proto sources, and the contracts follow our rules."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import grpc
import pytest

from proto import generate

ROOT = generate.REPO_ROOT


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    if generate.tool_version("grpcio-tools") != generate.GRPCIO_TOOLS_VERSION:
        pytest.skip(f"needs grpcio-tools=={generate.GRPCIO_TOOLS_VERSION}")
    # .pyi stubs depend on mypy-protobuf's version; compare them only with the pinned one.
    stubs = generate.tool_version("mypy-protobuf") == generate.MYPY_PROTOBUF_VERSION
    written = generate.generate(out_dir=tmp_path, stubs=stubs)
    assert written, "no .proto sources found"
    stale = [
        str(rel)
        for rel in written
        if not (ROOT / rel).exists() or (ROOT / rel).read_bytes() != (tmp_path / rel).read_bytes()
    ]
    assert not stale, f"stale generated code, run `python proto/generate.py`: {stale}"


def _load_grpc_module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "relpath", ["proto/kvcache/v1/kvcache_pb2_grpc.py", "proto/decode/v1/decode_pb2_grpc.py"]
)
def test_grpc_version_guard_accepts_1_84(relpath: str, monkeypatch: pytest.MonkeyPatch) -> None:
    path = ROOT / relpath
    pinned = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", path.read_text()).group(1)
    assert tuple(int(x) for x in pinned.split(".")) <= (1, 84, 0)
    for ok in ("1.84.0", "1.85.3", grpc.__version__):
        monkeypatch.setattr(grpc, "__version__", ok)
        _load_grpc_module(path, f"guard_check_{ok.replace('.', '_')}")
    monkeypatch.setattr(grpc, "__version__", "1.83.0")
    with pytest.raises(RuntimeError):
        _load_grpc_module(path, "guard_check_old")


FIELD = re.compile(r"^\s*(repeated\s+|optional\s+)?[\w.<>, ]+\s+\w+\s*=\s*\d+;")
ENUM_VALUE = re.compile(r"^\s*(\w+)\s*=\s*(\d+);")


def _needs_comment(line: str) -> bool:
    enum_value = ENUM_VALUE.match(line)
    if enum_value:
        # The *_UNSPECIFIED zero value explains itself.
        return enum_value.group(2) != "0"
    return bool(FIELD.match(line))


@pytest.mark.parametrize("source", generate.proto_sources(), ids=str)
def test_every_field_is_commented(source: Path) -> None:
    lines = (ROOT / source).read_text().splitlines()
    bare = [
        f"{source}:{i + 1}: {line.strip()}"
        for i, line in enumerate(lines)
        if _needs_comment(line) and not lines[i - 1].strip().startswith("//")
    ]
    assert not bare, "fields without a comment:\n" + "\n".join(bare)


@pytest.mark.parametrize("source", generate.proto_sources(), ids=str)
def test_enum_zero_values_are_unspecified(source: Path) -> None:
    text = (ROOT / source).read_text()
    for enum_name, body in re.findall(r"enum (\w+) \{(.*?)\}", text, re.S):
        zero = [name for name, num in ENUM_VALUE.findall(body) if num == "0"]
        assert zero and zero[0].endswith("_UNSPECIFIED"), f"{enum_name} zero value: {zero}"


def test_modes_match_layout_constants() -> None:
    from contract import layout
    from proto.kvcache.v1 import kvcache_pb2 as pb

    assert pb.RESIDENT == layout.MODE_RESIDENT and pb.OFFLOADED == layout.MODE_OFFLOADED
