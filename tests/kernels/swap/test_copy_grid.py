"""CopyGrid: the rule that picks the miss copy's working CTAs from the step's misses."""

from __future__ import annotations

import pytest

from kernels.swap.copy_grid import SPEC_GRAMMAR, CopyGrid, check_spec


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
    "kw",
    [
        dict(programs=0),
        dict(bytes_per_program=-1),
        dict(min_programs=0),
        dict(priority=1),
        dict(sms=-1),
    ],
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
    "kw",
    [
        dict(chunk_bytes=3072),
        dict(chunk_bytes=8),
        dict(warps=3),
        dict(warps=64),
        dict(stages=0),
        dict(stages=5),
        dict(stages=2, prefetch=True),  # two ways of loading ahead: one at a time
        dict(staged_bytes=-1),
        dict(staged_bytes=1 << 20, staged_chunks=0),
        dict(staged_bytes=1 << 20, staged_threads=0),
    ],
)
def test_rejects_bad_iterations(kw):
    with pytest.raises(ValueError):
        CopyGrid(**kw)


def test_labels_name_the_iteration_only_off_its_default():
    assert CopyGrid(8, chunk_bytes=64 << 10, warps=32).label() == "fixed 8 @64Kx32"
    assert CopyGrid(64, 2 << 20, 8, prefetch=True).label() == "<=64 >=8 2M @8Kp"
    assert CopyGrid(24, warps=8, priority=-1).label() == "fixed 24 @8Kx8 prio -1"
    assert CopyGrid(8, chunk_bytes=64 << 10, warps=32, sms=8).label() == "fixed 8 @64Kx32 own 8 SMs"
    assert CopyGrid(24, stages=2).label() == "fixed 24 @8Ks2"
    assert CopyGrid(24, staged_bytes=24 << 20).label() == "fixed 24 staged 24M"
    assert CopyGrid(24, staged_bytes=1 << 20, staged_threads=4).label() == "fixed 24 staged 1Mt4"


# The spec grammar of bench/profile/copy_sweep.py's --grids and the engine's --decode-copy-grid.
SPECS = {
    "24": CopyGrid(programs=24),
    "64/8/1M": CopyGrid(64, 1 << 20, 8),
    "64/8/1.5M@16Kx8p": CopyGrid(64, 3 << 19, 8, chunk_bytes=16 << 10, warps=8, prefetch=True),
    "132/16/768K@4K": CopyGrid(132, 768 << 10, 16, chunk_bytes=4096),
    "8@64Kx32": CopyGrid(8, chunk_bytes=64 << 10, warps=32),
    "24@8Kp": CopyGrid(24, prefetch=True),
    "7/1/100@256": CopyGrid(7, 100, chunk_bytes=256),
    "6/3/0": CopyGrid(6, 0, 3),
    "8@64Kx32g8": CopyGrid(8, chunk_bytes=64 << 10, warps=32, sms=8),
    "24g16": CopyGrid(24, sms=16),
    "24@8Ks2": CopyGrid(24, stages=2),
    "64/16/512K@4Kx2s3": CopyGrid(64, 512 << 10, 16, chunk_bytes=4096, warps=2, stages=3),
    "64/16/1M+h24M": CopyGrid(64, 1 << 20, 16, staged_bytes=24 << 20),
    "64+h1.5Mc4t12": CopyGrid(64, staged_bytes=3 << 19, staged_chunks=4, staged_threads=12),
    "8@64Kx32g8+h512Kt2": CopyGrid(
        8, chunk_bytes=64 << 10, warps=32, sms=8, staged_bytes=512 << 10, staged_threads=2
    ),
}


@pytest.mark.parametrize("spec", sorted(SPECS))
def test_spec_round_trip(spec):
    grid = CopyGrid.parse(spec)
    assert grid == SPECS[spec]
    assert grid.spec() == spec
    assert CopyGrid.parse(grid.spec()) == grid


def test_spec_spellings_read_alike():
    assert CopyGrid.parse("64/8/1536k@16k").spec() == "64/8/1.5M@16K"
    assert CopyGrid.parse("16@8K").spec() == "16"  # the default iteration is left out
    assert CopyGrid.parse("16@8Kx4").spec() == "16"


def test_default_is_the_callers_grid():
    mine = CopyGrid(64, 1 << 20, 16)
    assert CopyGrid.parse("default", default=mine) == mine
    wide = CopyGrid.parse("default@16Kx8p", default=mine)
    assert wide == CopyGrid(64, 1 << 20, 16, chunk_bytes=16 << 10, warps=8, prefetch=True)
    assert CopyGrid.parse("defaultg16", default=mine) == CopyGrid(64, 1 << 20, 16, sms=16)
    staged = CopyGrid(64, 1 << 20, 16, staged_bytes=24 << 20)
    assert CopyGrid.parse("default+h24M", default=mine) == staged
    with pytest.raises(ValueError, match="default"):
        CopyGrid.parse("default")  # no grid given to stand for it


@pytest.mark.parametrize(
    "spec",
    [
        "8@3K",
        "x",
        "8@64Kx3",
        "0",
        "64/8",
        "",
        "8@",
        "8@x8",
        "64/0/1M",
        "64/8/1.5",
        "8 ",
        "8g",
        "8g-1",
        "24@8Kps2",
        "24@8Ks",
        "24s2",
        "24+h",
        "24+h1Mc0",
        "24h1M",
        "24+h1Mt2c4",
    ],
)
def test_bad_specs_name_the_spec_and_the_grammar(spec):
    with pytest.raises(ValueError) as e:
        CopyGrid.parse(spec, default=CopyGrid())
    assert repr(spec) in str(e.value) and SPEC_GRAMMAR in str(e.value)
    with pytest.raises(ValueError):
        check_spec(spec)


def test_check_spec_reads_the_form_only():
    assert check_spec("default@16Kx8") == "default@16Kx8"
    assert check_spec("64/8/2M@16Kx8p") == "64/8/2M@16Kx8p"


def test_the_default_launch_has_no_spec():
    with pytest.raises(ValueError):
        CopyGrid().spec()
