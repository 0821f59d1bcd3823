"""What a prefill engine's NIXL writes read from (engine_client.kv.export_source), on CPU with a
stand-in agent that records the registrations (no nixl needed): the direct source registers the
cache as it is; the staged one registers a host buffer of one request's pages and gathers them
into it in token order, page-major like the host tier, so the spans of a staged write are those
of pages 0..n-1 and fewer: the decode side receives the same bytes either way."""

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


def test_auto_is_direct_on_cpu_and_a_bad_name_is_refused() -> None:
    agent, (rows, index) = _Agent(), _cache()
    source = export_source(agent, rows, index, P, most=3, name="auto")  # type: ignore[arg-type]
    assert source.name == "direct" and not isinstance(source, StagedSource)
    with pytest.raises(ValueError, match="one of auto, direct"):
        export_source(agent, rows, index, P, most=3, name="fast")  # type: ignore[arg-type]


@pytest.mark.gpu
def test_auto_stages_through_pinned_host_memory_on_a_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    agent, (rows, index) = _Agent(), _cache()
    rows, index = rows.cuda(), index.cuda()
    source = export_source(agent, rows, index, P, most=3, name="auto")  # type: ignore[arg-type]
    assert isinstance(source, StagedSource) and source.name == "staged"
    assert source.rows_stage.device.type == "cpu" and source.rows_stage.is_pinned()


@pytest.mark.parametrize("name", ["staged", "gathered"])
def test_the_staged_source_gathers_a_requests_pages_in_token_order(name) -> None:
    agent, (rows, index) = _Agent(), _cache()
    source = export_source(agent, rows, index, P, most=3, name=name)  # type: ignore[arg-type]
    assert isinstance(source, StagedSource) and source.name == name
    assert source.rows_stage.device == rows.device
    assert agent.regions[ROWS].address == source.rows_stage.data_ptr()
    assert agent.regions[ROWS].nbytes == L * 3 * P * D
    with source.pages([4, 1]) as pages:
        assert list(pages) == [0, 1]
        for layer in range(L):
            for i, page in enumerate((4, 1)):
                staged = source.rows_stage[i, layer]  # page-major, as the host tier
                assert torch.equal(staged, rows[layer, page * P : (page + 1) * P])
                assert torch.equal(source.index_stage[layer, i], index[layer, page])


def _written(spans, src: torch.Tensor, pages: int, D: int) -> torch.Tensor:
    """The host tier [pages, L, P, D] after `spans` copied bytes of `src` into a zeroed one."""
    dst = torch.zeros(pages * L * P * D, dtype=torch.uint8)
    flat = src.reshape(-1)
    for s in spans:
        dst[s.dst_offset : s.dst_offset + s.nbytes] = flat[s.src_offset : s.src_offset + s.nbytes]
    return dst


@pytest.mark.parametrize("name", ["staged", "gathered"])
@pytest.mark.parametrize("dst_pages", [[7, 3, 0], [3, 4, 5]])
def test_staged_spans_land_the_bytes_the_direct_ones_land(dst_pages, name) -> None:
    lay = layout_with(num_layers=L, page_size=P, num_pages=N)
    D = lay.row_bytes
    rows = torch.randint(0, 256, (L, N * P + 1, D), dtype=torch.uint8)
    index = torch.zeros((L, N + 1, P, lay.index_bytes), dtype=torch.uint8)
    direct, staged = _Agent(), _Agent()
    export_source(direct, rows, index, P, 3, "direct")  # type: ignore[arg-type]
    source = export_source(staged, rows, index, P, 3, name)  # type: ignore[arg-type]
    dst = Region(ROWS, 0, 8 * L * P * D, layer_stride=P * D, page_stride=L * P * D)
    src_pages = [5, 2, 3]
    want = prompt_spans(lay, direct.regions[ROWS], dst, src_pages, dst_pages, tokens=11)
    with source.pages(src_pages) as pages:
        got = prompt_spans(lay, staged.regions[ROWS], dst, pages, dst_pages, tokens=11)
        assert torch.equal(_written(got, source.rows_stage, 8, D), _written(want, rows, 8, D))
    # Direct: one span per layer and page. Staged, page-major: a full page is one span, and
    # so are consecutive host pages (3, 4, then the last page's first layer); the partial last
    # page's layers are a span each (its unwritten rows lie between them).
    assert len(want) == L * 3
    assert len(got) == (L if dst_pages == [3, 4, 5] else 2 + L)


def test_an_unknown_source_is_refused() -> None:
    rows, index = _cache()
    with pytest.raises(ValueError):
        export_source(_Agent(), rows, index, P, 3, "pinned")  # type: ignore[arg-type]
