"""bench/e2e_stats.py's steady window: all streams when the engine ran them at once; the first
wave when its admission limit ran fewer (then `running` says how many, and the limit the engine
showed last is reported)."""

from __future__ import annotations

from bench.e2e_stats import analyze


def _rec(first: float, tokens: int, gap: float = 1.0) -> dict:
    return {
        "submitted": 0.0,
        "arrivals": [first + i * gap for i in range(tokens)],
        "hits": 0,
        "misses": 0,
        "bytes_moved": 0,
        "finish": "LENGTH",
        "error": "",
    }


def test_streams_run_at_once_are_one_window() -> None:
    p = analyze([_rec(0.0, 20), _rec(1.0, 20), _rec(2.0, 20)], [], 3, None)
    assert p["steady"] and p["running"] == 3
    assert abs(p["window_s"] - 17.0) < 1e-9 and abs(p["tok_s"] - 3.0) < 1e-9


def test_under_an_admission_limit_the_window_is_the_first_wave() -> None:
    # Two at once; the other two start only as the first two end (at 19 and 20).
    recs = [_rec(0.0, 20), _rec(1.0, 20), _rec(19.5, 20), _rec(20.5, 20)]
    samples = [
        {"t": 5.0, "engine": {"engine_admission_limit": 3.0, "engine_admission_best_batch": 2.0}},
        {"t": 30.0, "engine": {"engine_admission_limit": 2.0, "engine_admission_best_batch": 2.0}},
    ]
    p = analyze(recs, samples, 4, None)
    assert p["steady"] and p["running"] == 2
    assert abs(p["window_s"] - 18.0) < 1e-9 and abs(p["tok_s"] - 2.0) < 1e-9
    assert (p["admission_limit"], p["admission_best_batch"]) == (2.0, 2.0)


def test_one_stream_is_its_whole_life() -> None:
    p = analyze([_rec(0.0, 5)], [], 1, None)
    assert p["steady"] and p["running"] == 1 and p["admission_limit"] is None
