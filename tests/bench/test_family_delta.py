"""bench.profile.family_delta on two stored profiles: the step and timeline first, then the
families by the size of their change, a family only one profile has counting 0 in the other."""

from __future__ import annotations

import json

import pytest

from bench.profile.family_delta import main, rows


def _profile(step: float, fams: dict[str, float], timeline: bool = True) -> dict:
    t = {"model_us": 100.0, "copy_us": 50.0, "copy_alone_us": 20.0, "idle_us": 5.0}
    return {
        "step_us": step,
        "timeline": t if timeline else None,
        "families": {k: {"us_per_step": v, "share": v / step} for k, v in fams.items()},
    }


def test_rows_put_the_largest_change_first() -> None:
    a = _profile(14000.0, {"rope": 400.0, "norms": 560.0, "attention": 3300.0})
    b = _profile(13300.0, {"rope": 60.0, "norms": 250.0, "attention": 3310.0, "plan": 5.0})
    got = rows(a, b)
    assert got[0] == ("step (timed)", 14.0, 13.3)
    assert [r[0] for r in got[1:5]] == [
        "timeline: model",
        "timeline: copy",
        "timeline: copy alone",
        "timeline: idle",
    ]
    assert [r[0] for r in got[5:]] == ["rope", "norms", "attention", "plan"]
    assert got[-1] == ("plan", 0.0, pytest.approx(0.005))


def test_profiles_without_a_timeline_show_families_only(tmp_path, capsys) -> None:
    a = _profile(1000.0, {"rope": 100.0}, timeline=False)
    b = _profile(900.0, {"rope": 20.0})
    assert [r[0] for r in rows(a, b)] == ["step (timed)", "rope"]
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    assert main([str(pa), str(pb)]) == 0
    out = capsys.readouterr().out
    assert "rope" in out and "-0.080" in out and "-0.100" in out
