"""Regenerate the Python code of every .proto under proto/ (messages, gRPC stubs, .pyi stubs).

Run from anywhere: `python -m proto.generate` or `python proto/generate.py`.
The generated code is committed; tests/proto/test_proto.py fails when it is stale.
Generation pins grpcio-tools (the generated gRPC version guard is its version) and the .pyi
stubs depend on mypy-protobuf's version, so both are checked before writing anything.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
GRPCIO_TOOLS_VERSION = "1.84.0"
MYPY_PROTOBUF_VERSION = "5.1.0"
CODE_SUFFIXES = ("_pb2.py", "_pb2_grpc.py")
STUB_SUFFIXES = ("_pb2.pyi", "_pb2_grpc.pyi")


def proto_sources(root: Path = REPO_ROOT) -> list[Path]:
    """Every .proto file, relative to the repo root (protoc's include dir)."""
    return sorted(p.relative_to(root) for p in (root / "proto").rglob("*.proto"))


def generated_files(root: Path = REPO_ROOT, stubs: bool = True) -> list[Path]:
    """Paths, relative to the root, of every file the generator writes."""
    suffixes = CODE_SUFFIXES + (STUB_SUFFIXES if stubs else ())
    return [src.with_name(src.stem + suffix) for src in proto_sources(root) for suffix in suffixes]


def tool_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_tool_versions(stubs: bool = True) -> None:
    want = {"grpcio-tools": GRPCIO_TOOLS_VERSION}
    if stubs:
        want["mypy-protobuf"] = MYPY_PROTOBUF_VERSION
    have = {name: tool_version(name) for name in want}
    if have != want:
        raise SystemExit(
            f"proto generation needs {want}, found {have}: "
            f"pip install grpcio-tools=={GRPCIO_TOOLS_VERSION} "
            f"mypy-protobuf=={MYPY_PROTOBUF_VERSION}"
        )


def _plugin(name: str) -> str:
    # The plugins live next to the interpreter in a venv even when it is not on PATH.
    found = shutil.which(
        name, path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    )
    if found is None:
        raise SystemExit(f"{name} not found: pip install mypy-protobuf=={MYPY_PROTOBUF_VERSION}")
    return found


def generate(out_dir: Path = REPO_ROOT, root: Path = REPO_ROOT, stubs: bool = True) -> list[Path]:
    """Run protoc on every source into out_dir; return the written files (relative paths).
    stubs=False skips the .pyi files (for checks where mypy-protobuf is another version)."""
    from grpc_tools import protoc

    check_tool_versions(stubs)
    well_known = Path(protoc.__file__).parent / "_proto"
    args = [
        f"-I{root}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
    ]
    if stubs:
        args += [
            f"--plugin=protoc-gen-mypy={_plugin('protoc-gen-mypy')}",
            f"--plugin=protoc-gen-mypy_grpc={_plugin('protoc-gen-mypy_grpc')}",
            f"--mypy_out={out_dir}",
            f"--mypy_grpc_out={out_dir}",
        ]
    # protoc names the generated modules after the source paths relative to the include dir,
    # which makes them importable as proto.<pkg>.v1.<name>_pb2; so run it from the root.
    code = "import sys; from grpc_tools import protoc; sys.exit(protoc.main(sys.argv))"
    result = subprocess.run(
        [sys.executable, "-c", code, *args, *(str(s) for s in proto_sources(root))],
        cwd=root,
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise SystemExit(f"protoc failed ({result.returncode}): {result.stderr}")
    return generated_files(root, stubs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=REPO_ROOT,
        help="directory to write into (default: the repo root, in place)",
    )
    written = generate(parser.parse_args().out)
    print("\n".join(str(p) for p in written))


if __name__ == "__main__":
    main()
