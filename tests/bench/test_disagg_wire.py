"""bench.disagg.wire: its argument checks without processes, and one small run between two
real processes over NIXL UCX (skipped without the nixl package), whose target must hold the
writer's bytes whatever the descriptor count."""

from __future__ import annotations

import json

import pytest

from bench.disagg import wire
from contract.nixl_agent import nixl_available


def test_sizes_that_do_not_split_evenly_are_refused() -> None:
    assert wire.parse_args(["--size", "4096", "--pieces", "1,4"]).pieces == [1, 4]
    for bad in (["--size", "4096", "--pieces", "3"], ["--size", "0"], ["--pieces", "0"]):
        with pytest.raises(SystemExit):
            wire.parse_args(bad)


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.skipif(not nixl_available(), reason="the nixl package is not installed")
def test_every_write_lands_whole(tmp_path) -> None:
    out = tmp_path / "wire.json"
    assert (
        wire.main(["--size", str(1 << 20), "--pieces", "1,64", "--repeats", "2", "--out", str(out)])
        == 0
    )
    writes = json.loads(out.read_text())["writes"]
    assert [(w["pieces"], w["state"]) for w in writes] == [(1, "DONE")] * 2 + [(64, "DONE")] * 2
    assert all(w["seconds"] > 0 for w in writes)
