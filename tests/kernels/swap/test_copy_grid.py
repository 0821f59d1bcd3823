"""CopyGrid: the rule that picks the miss copy's working CTAs from the step's misses."""

from __future__ import annotations

import pytest

from kernels.swap.copy_grid import CopyGrid


def test_active_follows_the_bytes_within_its_bounds():
    rule = CopyGrid(programs=64, bytes_per_program=656 * 100, min_programs=16)
    assert rule.rows_per_program(656) == 100
    assert rule.active(0, 656, 64) == 16  # no miss: the floor (those CTAs find no work)
    assert rule.active(1_600, 656, 64) == 16
    assert rule.active(2_401, 656, 64) == 25  # ceil(2401 / 100)
    assert rule.active(10**6, 656, 64) == 64  # capped by the launch
    assert rule.active(2_401, 656, 20) == 20  # a smaller launch caps the floor too
    # Wider rows, fewer rows per CTA: the same bytes take the same CTAs.
    assert rule.active(1_312, 1312, 64) == rule.active(2_624, 656, 64) == 27


def test_fixed_grid_and_tiny_budget():
    assert CopyGrid(programs=24).active(10**6, 656, 24) == 24
    assert CopyGrid(programs=24).rows_per_program(656) == 0
    one = CopyGrid(programs=8, bytes_per_program=1)  # below one row: one row per CTA
    assert one.rows_per_program(1152) == 1 and one.active(5, 1152, 8) == 5


@pytest.mark.parametrize(
    "kw", [dict(programs=0), dict(bytes_per_program=-1), dict(min_programs=0), dict(priority=1)]
)
def test_rejects_bad_rules(kw):
    with pytest.raises(ValueError):
        CopyGrid(**kw)


def test_labels():
    assert CopyGrid(programs=64).label() == "fixed 64"
    assert CopyGrid().label() == "fixed default"
    assert CopyGrid(64, 768 << 10, 16).label() == "<=64 >=16 768K"
    assert CopyGrid(132, 3 << 19, 8).label() == "<=132 >=8 1.5M"
    assert CopyGrid(7, 100).label() == "<=7 >=1 100B"
    assert CopyGrid(64, 1 << 20, 16, priority=-1).label() == "<=64 >=16 1M prio -1"
    assert CopyGrid(24, priority=-2).label() == "fixed 24 prio -2"


@pytest.mark.parametrize(
    "kw", [dict(chunk_bytes=3072), dict(chunk_bytes=8), dict(warps=3), dict(warps=64)]
)
def test_rejects_bad_iterations(kw):
    with pytest.raises(ValueError):
        CopyGrid(**kw)


def test_labels_name_the_iteration_only_off_its_default():
    assert CopyGrid(8, chunk_bytes=64 << 10, warps=32).label() == "fixed 8 @64Kx32"
    assert CopyGrid(64, 2 << 20, 8, prefetch=True).label() == "<=64 >=8 2M @8Kp"
    assert CopyGrid(24, warps=8, priority=-1).label() == "fixed 24 @8Kx8 prio -1"
