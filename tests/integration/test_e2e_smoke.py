"""`python -m bench.e2e --smoke` as the lead runs it, on CPU: the kv service and the engines as
separate processes, concurrent Generate streams, every KV mode, a JSON with sane numbers and
nothing left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine_client.serve.procs import REPO_ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

MODES = {"baseline", "embedded", "service", "service-remote-swap"}


def _run(out: Path) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ENGINE_", "KVS_"))}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.e2e", "--smoke", "--out", str(out)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=220,
    )
    return proc.returncode, proc.stdout + proc.stderr


def _check_phase(label: str, p: dict) -> None:
    assert p["errors"] == [] and p["streams_ok"] == p["concurrency"], (label, p)
    assert p["tokens"] > 0 and p["tok_s"] > 0, (label, p)
    assert p["ttft_p50_s"] > 0 and p["itl_p50_s"] > 0 and p["itl_p99_s"] >= p["itl_p50_s"], (
        label,
        p,
    )
    assert 0.0 <= p["hit_rate"] <= 1.0, (label, p)
    assert p["h2d_gbs"] is not None and p["h2d_gbs"] >= 0, (label, p)


def test_e2e_smoke_runs_every_mode(tmp_path: Path) -> None:
    out = tmp_path / "e2e.json"
    code, log = _run(out)
    assert code == 0, log[-4000:]
    data = json.loads(out.read_text())
    main = [r for r in data["runs"] if r["tag"] == "main"]
    assert {r["mode"] for r in main if r["source"] == "trace"} == MODES, log[-2000:]
    assert {r["source"] for r in main} == {"trace", "indexer"}
    for r in data["runs"]:
        assert "error" not in r and r["engine_exit"] == 0, r
        for name, p in r["phases"].items():
            _check_phase(f"{r['mode']} {r['source']} {r['tag']} {name}", p)
    plan = data["plans"]["256"]
    assert plan["hisparse"]["max_requests"] > plan["baseline"]["max_requests"] >= 1
    for r in main:
        want = plan["baseline" if r["mode"] == "baseline" else "hisparse"]["max_requests"]
        assert r["slots"] == want
        if "max" in r["phases"]:
            p = r["phases"]["max"]
            assert p["concurrency"] == want and 1 <= p["running"] <= want, p
            # The admission limit the engine showed: adaptive in the HiSparse modes, else fixed.
            assert 1 <= p["admission_limit"] <= want, p
            assert p["admission_limit"] == want or r["mode"] != "baseline", p
    # The baseline holds every row on the device; HiSparse modes go through the host tier.
    for r in main:
        hr = r["phases"][next(iter(r["phases"]))]["hit_rate"]
        assert (hr == 1.0) if r["mode"] == "baseline" else (hr < 1.0), r
    assert data["ratios"]["256 trace"]["max concurrency service/baseline"] > 1
    assert len([r for r in data["runs"] if r["tag"] != "main"]) == 2  # hit rate vs B
    assert data["leftover_segments"] == [] and data["skipped"] == []
    assert "ratios (same run" in log and "wall time" in log
    # The engine's own metrics, in the same windows: step time and GPU idle next to the ITL.
    views = [p for r in main for p in r["phases"].values() if p.get("step_gpu_s")]
    assert views and all(
        0 <= p["gpu_idle_frac"] <= 1 and p["itl_p50_over_step"] > 0 for p in views
    ), views
    # Its garbage collections (transport/gc_heap.py): the recorder runs in every engine process.
    assert all(p["gc_share"] is not None and p["gc_pause_max_s"] is not None for p in views), views
    assert "overlap: client ITL p50" in log
