"""bench.profile.copy_cost splits the copy's cost into interference and exposure that add up."""

from __future__ import annotations

import json

import pytest

from bench.profile.copy_cost import copy_cost, main


def _profile(step_us: float, busy_us: float, copy_us: float | None) -> dict:
    cats = {"attention": {"us_per_step": 1000.0}}
    if copy_us is not None:
        cats["miss copy"] = {"us_per_step": copy_us}
    return {"step_us": step_us, "busy_us_per_step": busy_us, "categories": cats}


def test_the_split_adds_up_to_the_cost() -> None:
    # Main-stream kernels 12.0 ms with the copy beside them (11.5 without): 0.5 interference;
    # idle 4.0 ms with the copy (0.5 without): 3.5 exposure; 16.0 - 12.0 = 4.0 = 0.5 + 3.5.
    c = copy_cost(_profile(16000, 19000, 7000), _profile(12000, 11500, None))
    assert c["cost_ms"] == pytest.approx(4.0)
    assert c["interference_ms"] == pytest.approx(0.5)
    assert c["exposure_ms"] == pytest.approx(3.5)
    assert c["interference_ms"] + c["exposure_ms"] == pytest.approx(c["cost_ms"])


def test_the_command_reads_two_profiles(tmp_path, capsys) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_profile(16000, 19000, 7000)))
    b.write_text(json.dumps(_profile(12000, 11500, None)))
    assert main([str(a), str(b)]) == 0
    assert "4.00 ms = 0.50 interference + 3.50 exposure" in capsys.readouterr().out
