"""The sm_90 residency arithmetic of bench/kernels/coresidency.py: what fits beside what."""

from __future__ import annotations

from bench.kernels.coresidency import Footprint, beside, ctas_per_sm

COPY = Footprint("copy", regs=40, smem=16, warps=4)


def test_a_kernel_that_fills_the_register_file_leaves_no_room() -> None:
    mix = Footprint("mix", regs=255, smem=100352, warps=8)  # 8,192 words a warp x 8 = 65,536
    assert ctas_per_sm(mix) == 1
    assert beside(mix, COPY) == 0


def test_registers_left_by_one_cta_decide_the_copies_beside_it() -> None:
    score = Footprint("score", regs=194, smem=221184, warps=8)  # 6,400 words a warp
    assert ctas_per_sm(score) == 1
    assert beside(score, COPY) == (65536 - 8 * 6400) // (4 * 1280) == 2


def test_shared_memory_and_warp_slots_bound_too() -> None:
    by_smem = Footprint("smem", regs=32, smem=100 * 1024, warps=4)
    assert ctas_per_sm(by_smem) == 2  # two CTAs of 101 KB with the driver's 1 KB each
    big_copy = Footprint("copy", regs=16, smem=40 * 1024, warps=4)
    assert beside(by_smem, big_copy) == 0  # 26 KB of shared memory left
    by_warps = Footprint("warps", regs=16, smem=0, warps=32)
    assert ctas_per_sm(by_warps) == 2 and beside(by_warps, COPY) == 0
