"""What a prefill engine's NIXL writes read from (engine_client.kv.export_source), on CPU with a
stand-in agent that records the registrations (no nixl needed): the direct source registers the
cache as it is; the staged one registers a host buffer of one request's pages and gathers them
into it in token order, so the spans of a staged write are those of pages 0..n-1."""

from __future__ import annotations

import pytest
import torch

from contract.nixl_agent import region_of
from contract.transfer_target import INDEX, ROWS, Region, prompt_spans
from engine_client.kv.export_source import StagedSource, export_source
from tests.process_harness import layout_with

L, N, P, D, I = 2, 6, 4, 8, 5  # layers, pages, page size, row bytes, index bytes per token


class _Agent:
    """Records what is registered, as contract.nixl_agent.NixlAgent keeps it."""

    def __init__(self) -> None:
        self.regions: dict[str, Region] = {}

    def register(self, name: str, tensor: torch.Tensor, layer: int, page: int) -> Region:
        self.regions[name] = region_of(name, tensor, layer, page)
        return self.regions[name]


def _cache() -> tuple[torch.Tensor, torch.Tensor]:
    """The baseline's stored bytes: rows [L, N * P + 1 (sink), D], keys [L, N + 1, P, I]."""
    rows = torch.randint(0, 256, (L, N * P + 1, D), dtype=torch.uint8)
    index = torch.randint(0, 256, (L, N + 1, P, I), dtype=torch.uint8)
    return rows, index


def test_the_direct_source_registers_the_cache_itself() -> None:
    agent, (rows, index) = _Agent(), _cache()
    source = export_source(agent, rows, index, P, most=3, name="direct")  # type: ignore[arg-type]
    assert agent.regions[ROWS].address == rows.data_ptr()
    assert agent.regions[ROWS].page_stride == P * D
    assert agent.regions[INDEX].address == index.data_ptr()
    with source.pages([4, 1]) as pages:
        assert list(pages) == [4, 1]


def test_the_staged_source_gathers_a_requests_pages_in_token_order() -> None:
    agent, (rows, index) = _Agent(), _cache()
    source = export_source(agent, rows, index, P, most=3, name="staged")  # type: ignore[arg-type]
    assert isinstance(source, StagedSource)
    assert agent.regions[ROWS].address == source.rows_stage.data_ptr()
    assert agent.regions[ROWS].nbytes == L * 3 * P * D
    with source.pages([4, 1]) as pages:
        assert list(pages) == [0, 1]
        for layer in range(L):
            for i, page in enumerate((4, 1)):
                staged = source.rows_stage[layer, i * P : (i + 1) * P]
                assert torch.equal(staged, rows[layer, page * P : (page + 1) * P])
                assert torch.equal(source.index_stage[layer, i], index[layer, page])


def test_staged_spans_read_the_bytes_the_direct_ones_read() -> None:
    lay = layout_with(num_layers=L, page_size=P, num_pages=N)
    D = lay.row_bytes
    rows = torch.randint(0, 256, (L, N * P + 1, D), dtype=torch.uint8)
    index = torch.zeros((L, N + 1, P, lay.index_bytes), dtype=torch.uint8)
    direct, staged = _Agent(), _Agent()
    export_source(direct, rows, index, P, 3, "direct")  # type: ignore[arg-type]
    source = export_source(staged, rows, index, P, 3, "staged")  # type: ignore[arg-type]
    dst = Region(ROWS, 0, 8 * L * P * D, layer_stride=P * D, page_stride=L * P * D)
    src_pages, dst_pages = [5, 2], [7, 3]
    want = prompt_spans(lay, direct.regions[ROWS], dst, src_pages, dst_pages, tokens=7)
    flat = rows.view(-1)
    with source.pages(src_pages) as pages:
        got = prompt_spans(lay, staged.regions[ROWS], dst, pages, dst_pages, tokens=7)
        stage = source.rows_stage.view(-1)
        for w, g in zip(want, got, strict=True):
            assert (w.dst_offset, w.nbytes) == (g.dst_offset, g.nbytes)
            read = stage[g.src_offset : g.src_offset + g.nbytes]
            assert torch.equal(read, flat[w.src_offset : w.src_offset + w.nbytes])


def test_an_unknown_source_is_refused() -> None:
    rows, index = _cache()
    with pytest.raises(ValueError):
        export_source(_Agent(), rows, index, P, 3, "pinned")  # type: ignore[arg-type]
