"""Where a prefill engine writes a prompt's KV on the decode side (prefill/decode
disaggregation, issue 42): the decode service's NIXL agent and the regions it registered, and
the byte spans that carry a request's prompt from one side's pages into the other's.

A region is paged: the bytes of (layer l, page p) start at address + l * layer_stride +
p * page_stride. Both sides describe their memory that way, so one rule maps the prefill
engine's cache (layer-major rows) onto the service's host tier (page-major rows):
- rows: per (layer, page), the page's written tokens, row_bytes each;
- index keys: per (layer, page), the whole page block (an fp8 page keeps its scales after
  its values, `kernels.reference.index_pool`), so a partial last page is copied whole; the
  positions after the prompt are private to the request and rewritten by its decode appends.
Pure arithmetic, no NIXL: `contract.nixl_agent` moves the spans.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from contract.errors import InvalidArgument
from contract.layout import KVLayout

ROWS, INDEX = "rows", "index"
# Where a prefill engine's writes read from (engine_client.kv.export_source): auto (staged on
# CUDA, direct on CPU), its cache itself (host on CPU, the device on CUDA), a pinned host
# buffer it stages each prompt into, or a buffer beside the cache (the device on CUDA) it
# gathers each prompt into, page-major.
SOURCES = ("auto", "direct", "staged", "gathered")


@dataclass(frozen=True)
class Region:
    """One registered memory region and its page geometry (bytes)."""

    name: str
    address: int
    nbytes: int
    layer_stride: int
    page_stride: int
    memory_type: str = "DRAM"  # NIXL's: DRAM (host) or VRAM (device)
    device_id: int = 0

    def at(self, layer: int, page: int) -> int:
        """Offset of (layer, page) from the region's start."""
        return layer * self.layer_stride + page * self.page_stride


@dataclass(frozen=True)
class TransferTarget:
    """A NIXL agent a peer can write to: its name, its metadata and its regions."""

    agent_name: str
    metadata: bytes
    regions: tuple[Region, ...]
    layout: KVLayout

    def region(self, name: str) -> Region:
        for r in self.regions:
            if r.name == name:
                return r
        raise InvalidArgument(f"the transfer target has no {name!r} region", region=name)


@dataclass(frozen=True)
class Span:
    """Copy nbytes from src_offset of the local region to dst_offset of the remote one."""

    src_offset: int
    dst_offset: int
    nbytes: int


def prompt_spans(
    layout: KVLayout,
    src: Region,
    dst: Region,
    src_pages: Sequence[int],
    dst_pages: Sequence[int],
    tokens: int,
    cached_tokens: int = 0,
) -> list[Span]:
    """The spans that copy the KV of prompt tokens [cached_tokens, tokens) from pages
    `src_pages` of `src` to pages `dst_pages` of `dst` (both in token order), for the region
    named by src.name. The cached prefix's pages are the decode side's shared pages: skipped."""
    P = layout.page_size
    used = -(-tokens // P)
    if tokens < 1 or used > min(len(src_pages), len(dst_pages)):
        raise InvalidArgument(
            f"{tokens} tokens need {used} pages on each side, got "
            f"{len(src_pages)} and {len(dst_pages)}",
            tokens=tokens,
        )
    if cached_tokens % P or not 0 <= cached_tokens < tokens:
        raise InvalidArgument(
            f"a cached prefix of {cached_tokens} tokens is not whole pages of a "
            f"{tokens}-token prompt",
            cached_tokens=cached_tokens,
        )
    spans = []
    for layer in range(layout.num_layers):
        for i in range(cached_tokens // P, used):
            if src.name == ROWS:
                nbytes = min(P, tokens - i * P) * layout.row_bytes
            else:
                nbytes = P * layout.index_bytes
            span = Span(src.at(layer, src_pages[i]), dst.at(layer, dst_pages[i]), nbytes)
            _check_within(span, src, dst)
            spans.append(span)
    return merged(spans)


def merged(spans: Sequence[Span]) -> list[Span]:
    """The same bytes in the fewest spans: in source order, a span that starts where the one
    before ends on both sides extends it. Each span is one NIXL descriptor, and a descriptor
    costs the transport a message: a layer-major index pool, or a page-major staging buffer
    written into the page-major host tier, turns a run of consecutive pages into one write."""
    out: list[Span] = []
    for s in sorted(spans, key=lambda s: s.src_offset):
        last = out[-1] if out else None
        if (
            last is not None
            and last.src_offset + last.nbytes == s.src_offset
            and last.dst_offset + last.nbytes == s.dst_offset
        ):
            out[-1] = Span(last.src_offset, last.dst_offset, last.nbytes + s.nbytes)
        else:
            out.append(s)
    return out


def _check_within(span: Span, src: Region, dst: Region) -> None:
    """A span past either region's end would write another tenant's memory: refuse it."""
    if span.src_offset + span.nbytes > src.nbytes or span.dst_offset + span.nbytes > dst.nbytes:
        raise InvalidArgument(
            f"a {src.name} span [{span.dst_offset}, +{span.nbytes}) falls outside the regions",
            region=src.name,
        )
