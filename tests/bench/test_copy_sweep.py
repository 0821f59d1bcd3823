"""bench/profile/copy_sweep.py: the grid specs it reads, and one tiny sweep end to end on CPU."""

from __future__ import annotations

import json

import pytest

from bench.profile.copy_sweep import main, setting
from engine_client.kv.hisparse import OVERLAP_COPY_GRID
from kernels.swap.copy_grid import CopyGrid


def test_grid_specs():
    assert setting("none").grid is None
    assert setting("24").grid == CopyGrid(programs=24)
    assert setting("default").grid == OVERLAP_COPY_GRID
    rule = setting("132/16/1536K@4K")
    assert rule.grid == CopyGrid(
        programs=132, bytes_per_program=1536 << 10, min_programs=16, chunk_bytes=4096
    )
    assert (rule.chunk, rule.warps) == (4096, 4)  # the grid's whole launch, defaults included
    wide = setting("16@16Kx8p")
    assert (wide.chunk, wide.warps, wide.prefetch) == (16384, 8, True)
    assert not setting("16@16Kx8").prefetch and setting("24@8Kp").chunk == 8192
    assert setting("64/8/1.5M").grid.bytes_per_program == 3 << 19
    none = setting("none")
    assert (none.chunk, none.warps, none.prefetch) == (0, 0, False)
    # One parser: the sweep's specs are CopyGrid's, `default` is the backend's grid.
    assert setting("64/8/2M@16Kx8p").grid == CopyGrid.parse("64/8/2M@16Kx8p")
    assert setting("default@16Kx8").grid.chunk_bytes == 16384
    assert setting("default@16Kx8").grid.programs == OVERLAP_COPY_GRID.programs
    for bad in ("64/8", "8@3K", "none@8K"):
        with pytest.raises(ValueError):
            setting(bad)


@pytest.mark.slow
def test_tiny_sweep_on_cpu(tmp_path):
    out = tmp_path / "sweep.json"
    argv = ["--preset", "tiny", "--context", "64", "--batch", "3", "--steps", "2"]
    assert main(argv + ["--grids", "none,2,8/2/1K", "--rounds", "2", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert [(row["spec"], row["round"]) for row in r["rows"]] == [
        (s, n) for n in range(2) for s in ("none", "2", "8/2/1K")
    ]
    by_spec = {o["spec"]: o for o in r["summary"]}
    assert by_spec["none"]["copy_cost_ms"] == 0 and by_spec["none"]["working_ctas"] is None
    assert by_spec["2"]["working_ctas"] == 2
    # The replayed trace misses some rows every step; the rule's CTAs follow them.
    launch = by_spec["8/2/1K"]["miss_rows_per_launch"]
    assert launch > 0
    assert by_spec["8/2/1K"]["working_ctas"] == CopyGrid(8, 1024, 2).active(round(launch), 1152, 8)
