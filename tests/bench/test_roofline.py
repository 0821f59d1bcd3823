"""bench/e2e/roofline.py: the arithmetic of the decode roofline, against numbers worked by hand."""

from __future__ import annotations

import pytest

from bench.e2e.roofline import (
    Ceilings,
    analyze,
    fixed_cost_s,
    limit_tok_s,
    per_request_layer_s,
    request_layer_traffic,
    step_limit_s,
)

CEIL = Ceilings(h2d_gbs=10.0, hbm_gbs=1000.0)


def test_traffic_of_one_request_layer():
    t = request_layer_traffic(
        context=1000, topk=100, row_bytes=1000, index_bytes=100, miss_rate=0.1
    )
    # keys 1000 x 100 B; scores 1000 x 4 B written + read; 100 rows x 1000 B; 10 missed rows.
    assert (t.index, t.scores, t.attention, t.miss_write, t.pcie) == (
        100_000,
        8_000,
        100_000,
        10_000,
        10_000,
    )
    assert t.hbm == 218_000
    short = request_layer_traffic(
        context=40, topk=100, row_bytes=1000, index_bytes=100, miss_rate=0.5
    )
    assert short.attention == 40_000 and short.pcie == 20_000  # k = min(topk, context)


def test_step_limits_serial_and_overlapped():
    t = request_layer_traffic(1000, 100, 1000, 100, 0.1)
    # HBM 218 kB / 1 TB/s = 0.218 us; PCIe 10 kB / 10 GB/s = 1 us.
    assert per_request_layer_s(t, CEIL, overlap=False) == pytest.approx(1.218e-6)
    assert per_request_layer_s(t, CEIL, overlap=True) == pytest.approx(1.0e-6)
    assert fixed_cost_s(1e-3, t, CEIL, num_layers=2) == pytest.approx(1e-3 - 2 * 1.218e-6)
    assert fixed_cost_s(1e-6, t, CEIL, num_layers=2) == 0.0  # never negative
    assert step_limit_s(10, 2, 1e-3, t, CEIL, overlap=False) == pytest.approx(1.02436e-3)
    assert step_limit_s(10, 2, 1e-3, t, CEIL, overlap=True) == pytest.approx(1.02e-3)
    assert limit_tok_s(10, 2, 1e-3, t, CEIL, overlap=True) == pytest.approx(10 / 1.02e-3)


def _phase(n, tok_s, hit_rate):
    return {"concurrency": n, "tok_s": tok_s, "hit_rate": hit_rate}


def _payload(ceilings):
    runs = [
        {
            "context": 1000,
            "mode": "baseline",
            "source": "trace",
            "tag": "main",
            "phases": {"batch1": _phase(1, 200.0, 1.0), "max": _phase(4, 600.0, 1.0)},
        },
        {
            "context": 1000,
            "mode": "service",
            "source": "trace",
            "tag": "main",
            "phases": {"batch1": _phase(1, 250.0, 0.75), "max": _phase(10, 1000.0, 0.75)},
        },
    ]
    sizes = {
        "num_layers": 2,
        "topk": 100,
        "row_format": "bf16",
        "index_format": "fp8",
        "prompt_len": 0,
        "contexts": [1000],
    }
    return {"ceilings": ceilings, "sizes": sizes, "runs": runs}


def test_analyze_an_e2e_payload():
    p = _payload({"h2d_gbs": 28.8, "d2d_gbs": 2552.0})
    roof = analyze(p)
    # Baseline: keys 132 kB + scores 8 kB + rows 115.2 kB = 255.2 kB -> 0.1 us at 2552 GB/s.
    # Service, 25% misses: + 28.8 kB written (HBM) and read over PCIe at 28.8 GB/s: 1 us.
    base_s, svc_s = 0.1e-6, 284_000 / 2552e9 + 1e-6
    fixed_base, fixed_svc = 1 / 200 - 2 * base_s, 1 / 250 - 2 * svc_s
    ctx = roof["contexts"]["1000"]
    assert ctx["fixed_ms_by_mode"]["baseline"] == pytest.approx(1e3 * fixed_base)
    assert ctx["fixed_ms"] == pytest.approx(1e3 * fixed_svc)  # the smaller one
    svc = p["runs"][1]["phases"]["max"]["roofline"]
    step = fixed_svc + 10 * 2 * svc_s
    assert svc["limit_tok_s"] == pytest.approx(10 / step)
    assert svc["achieved_over_limit"] == pytest.approx(1000 * step / 10)
    assert svc["share"]["pcie"] == pytest.approx(20 * 1e-6 / step)
    base = p["runs"][0]["phases"]["max"]["roofline"]
    assert base["pcie_bytes"] == 0 and base["limit_tok_s"] == pytest.approx(
        4 / (fixed_svc + 4 * 2 * base_s)
    )
    assert ctx["ratios"]["service/baseline at max, limit"] == pytest.approx(
        svc["limit_tok_s"] / base["limit_tok_s"]
    )
    assert ctx["ratios"]["service/baseline at max, achieved"] == pytest.approx(1000 / 600)


def test_no_ceilings_no_roofline():
    p = _payload(None)
    assert "skipped" in analyze(p)
    assert "roofline" not in p["runs"][0]["phases"]["max"]
