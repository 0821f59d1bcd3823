"""bench/disagg/nixl_wheel.py: the expert-parallel torch extensions leave the wheel and its RECORD;
every other member keeps its bytes."""

from __future__ import annotations

import zipfile
from pathlib import Path

from bench.disagg.nixl_wheel import slim

MEMBERS = {
    "nixl_cu13/__init__.py": b"x = 1\n",
    "nixl_ep_cu13/__init__.py": b"y = 2\n",
    "nixl_ep_cu13/nixl_ep_cpp_torch213.cpython-312-x86_64-linux-gnu.so": b"\0" * 4096,
    "nixl_ep_cu13/nixl_ep_cpp_torch214.cpython-312-x86_64-linux-gnu.so": b"\1" * 4096,
}


def test_slim_drops_the_torch_extensions_and_their_record_lines(tmp_path: Path) -> None:
    wheel = tmp_path / "nixl_cu13-1.5.1-cp312-cp312-manylinux_2_28_x86_64.whl"
    record = "".join(f"{name},sha256=abc,{len(data)}\n" for name, data in MEMBERS.items())
    with zipfile.ZipFile(wheel, "w") as z:
        for name, data in MEMBERS.items():
            z.writestr(name, data)
        z.writestr(
            "nixl_cu13-1.5.1.dist-info/RECORD", record + "nixl_cu13-1.5.1.dist-info/RECORD,,\n"
        )
    before, after, dropped = slim(str(wheel))
    assert dropped == 2 and after < before
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        assert names == {
            "nixl_cu13/__init__.py",
            "nixl_ep_cu13/__init__.py",
            "nixl_cu13-1.5.1.dist-info/RECORD",
        }
        assert z.read("nixl_ep_cu13/__init__.py") == b"y = 2\n"
        lines = z.read("nixl_cu13-1.5.1.dist-info/RECORD").decode().splitlines()
    assert [ln.split(",")[0] for ln in lines] == [
        "nixl_cu13/__init__.py",
        "nixl_ep_cu13/__init__.py",
        "nixl_cu13-1.5.1.dist-info/RECORD",
    ]
    assert slim(str(wheel))[2] == 0  # a second pass finds nothing more to drop
