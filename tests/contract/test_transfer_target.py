"""The byte spans of a disaggregated prompt (contract.transfer_target), and a NIXL agent's
WRITE between two processes on CPU (contract.nixl_agent; skipped without nixl): a layer-major
cache lands page-major, and the agents leave no registration behind."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from contract.errors import InvalidArgument
from contract.nixl_agent import NixlAgent, nixl_available, region_of, transfer_descs
from contract.transfer_target import INDEX, ROWS, Region, merged, prompt_spans
from tests.process_harness import layout_with

LAYOUT = layout_with(num_layers=2, page_size=4, num_pages=6)
L, P, D, N = 2, 4, LAYOUT.row_bytes, 6


def _regions() -> tuple[Region, Region]:
    """Source [L, N * P, D] (layer-major, like the baseline), target [N, L, P, D]."""
    src = Region(ROWS, 0, L * N * P * D, layer_stride=N * P * D, page_stride=P * D)
    dst = Region(ROWS, 0, N * L * P * D, layer_stride=P * D, page_stride=L * P * D)
    return src, dst


def test_rows_go_page_by_page_with_the_written_tokens_only() -> None:
    src, dst = _regions()
    spans = prompt_spans(LAYOUT, src, dst, [1, 0], [5, 2], tokens=6)
    assert sorted((s.src_offset, s.dst_offset, s.nbytes) for s in spans) == sorted(
        [
            (src.at(0, 1), dst.at(0, 5), 4 * D),
            (src.at(0, 0), dst.at(0, 2), 2 * D),
            (src.at(1, 1), dst.at(1, 5), 4 * D),
            (src.at(1, 0), dst.at(1, 2), 2 * D),
        ]
    )


def test_spans_contiguous_on_both_sides_are_one() -> None:
    # Layer-major on both sides (the index keys): consecutive pages make one span a layer;
    # a gap on either side keeps two.
    block = P * LAYOUT.index_bytes
    pool = Region(INDEX, 0, L * N * block, layer_stride=N * block, page_stride=block)
    spans = prompt_spans(LAYOUT, pool, pool, [1, 2, 3], [0, 1, 2], tokens=12)
    assert [(s.src_offset, s.dst_offset, s.nbytes) for s in spans] == [
        (pool.at(layer, 1), pool.at(layer, 0), 3 * block) for layer in (0, 1)
    ]
    spans = prompt_spans(LAYOUT, pool, pool, [1, 2, 3], [0, 1, 4], tokens=12)
    assert [s.nbytes for s in spans] == [2 * block, block] * 2
    assert merged([]) == []


def test_the_pages_of_a_cached_prefix_are_not_written() -> None:
    # The decode side's cached prefix pages are shared with other requests: read-only.
    src, dst = _regions()
    spans = prompt_spans(LAYOUT, src, dst, [1, 0, 3], [5, 2, 4], tokens=10, cached_tokens=4)
    assert [(s.src_offset, s.dst_offset) for s in spans] == [
        (src.at(layer, page), dst.at(layer, to))
        for layer in (0, 1)
        for page, to in ((0, 2), (3, 4))
    ]
    for cached in (2, 12):  # not whole pages; the whole prompt
        with pytest.raises(InvalidArgument):
            prompt_spans(LAYOUT, src, dst, [1, 0, 3], [5, 2, 4], tokens=10, cached_tokens=cached)


def test_index_keys_go_as_whole_page_blocks() -> None:
    block = P * LAYOUT.index_bytes
    pool = Region(INDEX, 0, L * N * block, layer_stride=N * block, page_stride=block)
    spans = prompt_spans(LAYOUT, pool, pool, [0], [3], tokens=1)
    assert [s.nbytes for s in spans] == [block, block]


def test_a_span_outside_a_region_or_too_few_pages_is_refused() -> None:
    src, dst = _regions()
    with pytest.raises(InvalidArgument):
        prompt_spans(LAYOUT, src, dst, [0, 1], [0, N], tokens=8)  # page N is past the end
    with pytest.raises(InvalidArgument):
        prompt_spans(LAYOUT, src, dst, [0], [0], tokens=5)  # 5 tokens need 2 pages


class _CudaStandIn:
    """What `region_of` reads of a tensor, as a CUDA tensor on device 1 answers (no GPU here)."""

    device = torch.device("cuda", 1)

    def is_contiguous(self) -> bool:
        return True

    def data_ptr(self) -> int:
        return 0x7F0000000000

    def numel(self) -> int:
        return L * N * P * D

    def element_size(self) -> int:
        return 1


def test_a_gpu_cache_is_registered_as_device_memory_and_written_from_there() -> None:
    # GPU -> remote host: the local descriptors name VRAM of the cache's device, the remote
    # ones the decode side's host tier (DRAM, device 0).
    src = region_of(ROWS, _CudaStandIn(), N * P * D, P * D)
    assert (src.memory_type, src.device_id, src.nbytes) == ("VRAM", 1, L * N * P * D)
    host = region_of(ROWS, torch.zeros(N * L * P * D, dtype=torch.uint8), P * D, L * P * D)
    assert (host.memory_type, host.device_id) == ("DRAM", 0)
    spans = prompt_spans(LAYOUT, src, host, [1], [2], tokens=3)
    local, remote = transfer_descs(src, host, spans)
    assert local.tolist() == [[src.address + s.src_offset, s.nbytes, 1] for s in spans]
    assert remote.tolist() == [[host.address + s.dst_offset, s.nbytes, 0] for s in spans]
    with pytest.raises(ValueError):
        region_of(ROWS, torch.zeros((4, 4), dtype=torch.uint8).t(), 4, 4)


def _target_side(conn) -> None:
    host = torch.zeros((N, L, P, D), dtype=torch.uint8)
    agent = NixlAgent("test-target")
    agent.register(ROWS, host, layer_stride=host.stride(1), page_stride=host.stride(0))
    conn.send(agent.target(LAYOUT))
    conn.recv()  # the write is done
    conn.send((host.numpy().copy(), agent.registered))
    agent.close()
    conn.send(agent.registered)


def _prefill_side(conn, target) -> None:
    """Writes 7 tokens of two pages into the target; sends the cache and what it checked."""
    cache = torch.randint(0, 256, (L, N * P, D), dtype=torch.uint8)
    agent = NixlAgent("test-prefill")
    agent.register(ROWS, cache, layer_stride=cache.stride(0), page_stride=P * cache.stride(1))
    spans = prompt_spans(LAYOUT, agent.region(ROWS), target.region(ROWS), [2, 0], [1, 4], 7)
    written, seconds = agent.write_timed(target, [(ROWS, spans)])
    agent.close()
    # By value (numpy), not as a torch tensor: torch shares one by a file descriptor that the
    # receiver fetches from this process, which exits right after the send.
    conn.send((cache.numpy().copy(), written, seconds, agent.registered))


@pytest.mark.skipif(not nixl_available(), reason="the nixl package is not installed")
def test_a_write_between_two_processes_lands_page_major() -> None:
    # Both agents live in child processes: nixl's native libraries, once loaded here, would
    # crash grpc_tools' compiler that a later test of this session loads (tests/proto).
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    mine, theirs = ctx.Pipe()
    child = ctx.Process(target=_target_side, args=(there,))
    child.start()
    writer = None
    try:
        target = here.recv()
        writer = ctx.Process(target=_prefill_side, args=(theirs, target))
        writer.start()
        cache_np, written, seconds, left = mine.recv()
        cache = torch.from_numpy(cache_np)
        assert written == L * 7 * D and left == 0
        assert list(seconds) == [ROWS] and 0 < seconds[ROWS] < 60  # posted to done
        here.send("done")
        host_np, registered = here.recv()
        host = torch.from_numpy(host_np)
        assert registered == 1 and here.recv() == 0
        for layer in range(L):
            assert torch.equal(host[1, layer], cache[layer, 8:12])
            assert torch.equal(host[4, layer, :3], cache[layer, 0:3])
        assert not host[[0, 2, 3, 5]].any() and not host[4, :, 3:].any()
    finally:
        child.join(30)
        if writer is not None:
            writer.join(30)
    assert child.exitcode == 0 and writer is not None and writer.exitcode == 0
