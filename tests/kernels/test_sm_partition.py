"""kernels/sm_partition.py: two disjoint SM groups, each a stream, eager and inside a graph."""

from __future__ import annotations

import pytest
import torch

from kernels.sm_partition import SmPartitionError, split_sms


def test_without_cuda_it_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SmPartitionError, match="CUDA device"):
        split_sms(8)


def _sms_used(stream: torch.cuda.Stream, graphed: bool) -> set[int]:
    """The SMs that 4 CTAs per SM of a %smid kernel ran on, launched on `stream` (forked from
    and joined to the current stream, as the engine's copy is; captured first if `graphed`)."""
    import triton
    import triton.language as tl

    @triton.jit
    def smid(out_ptr):
        sm = tl.inline_asm_elementwise(
            "mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1
        )
        tl.store(out_ptr + tl.program_id(0), sm)

    n = 4 * torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.full((n,), -1, dtype=torch.int32, device="cuda")

    def launch():
        cur = torch.cuda.current_stream()
        stream.wait_stream(cur)
        with torch.cuda.stream(stream):
            smid[(n,)](out, num_warps=1)
        cur.wait_stream(stream)

    launch()  # compiles
    if graphed:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            launch()
        out.fill_(-1)
        graph.replay()
    torch.cuda.synchronize()
    used = set(out.tolist())
    assert -1 not in used  # every CTA ran
    return used


@pytest.mark.gpu
@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graph"])
def test_the_groups_are_disjoint_and_sized(graphed):
    total = torch.cuda.get_device_properties(0).multi_processor_count
    part = split_sms(8)
    assert part.sms >= 8 and part.sms + part.rest_sms <= total
    small, rest = _sms_used(part.small, graphed), _sms_used(part.rest, graphed)
    assert len(small) <= part.sms and len(rest) <= part.rest_sms
    assert not small & rest


@pytest.mark.gpu
@pytest.mark.parametrize("sms", [0, 10_000])
def test_rejects_sizes_outside_the_device(sms):
    with pytest.raises(ValueError, match="sms"):
        split_sms(sms)
