"""What bench/prefix/cli.py runs: sizes, and the sizing of each run at one GPU KV budget G.

HiSparse GPU bytes (bench/e2e/plan.py): per request slot the hot buffers, residency state and
page-table row, plus the index keys of every page in the pool. Without sharing every request
holds `context` tokens of pages; with sharing the `shared` prefix's pages are held once:
    R x (slot bytes + (context - shared) tokens of keys) + shared tokens of keys <= G.
The baseline's paged cache holds R x context tokens of rows and keys (its pool is sized by its
request slots, so sharing saves it prefill compute, not capacity).
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.e2e import plan as e2e_plan
from bench.e2e.run_args import TRACE_SOURCE
from bench.shared.child import engine_argv, local_kv
from contract import flags
from contract.layout import INDEX_FORMATS
from engine_client.serve.settings.local_layout import LocalLayout


@dataclass(frozen=True)
class Sizes:
    """Every size of a run of bench/prefix/cli.py (see its --help)."""

    preset: str
    device: str
    gpu_kv_bytes: int
    context: int  # tokens reserved per request in the capacity part
    shared: int  # of which this many are a prefix common to every request
    prompt_len: int  # real (prefilled) distinct prompt tokens after the synthetic context
    steady_steps: int  # decode steps with every stream running
    hot_slots: int
    window: int
    page_size: int
    prefill_chunk: int
    ttft_suffix: int  # distinct prompt tokens after a real shared prefix of `shared`
    ttft_repeats: int
    conversations: int
    turns: int
    message: int  # new user tokens per turn
    answer: int  # generated tokens per turn
    index_format: str = "fp8"
    row_format: str = "bf16"
    sources: tuple[str, ...] = ("trace", "indexer")  # top-k sources of the capacity part
    admission_limit: str = "auto"  # the engines' --admission-limit

    def e2e(self) -> e2e_plan.Sizes:
        return e2e_plan.Sizes(
            preset=self.preset,
            contexts=(self.context,),
            gpu_kv_bytes=self.gpu_kv_bytes,
            hot_slots=self.hot_slots,
            window=self.window,
            page_size=self.page_size,
            prompt_len=self.prompt_len,
            steady_steps=self.steady_steps,
            batch1_tokens=1,
            device=self.device,
            sweep_requests=1,
            index_format=self.index_format,
            row_format=self.row_format,
        )


@dataclass(frozen=True)
class Capacity:
    """One capacity run: `slots` concurrent requests of `context` tokens in budget G."""

    mode: str
    sharing: bool
    slots: int
    pages: int
    new_tokens: int

    @property
    def label(self) -> str:
        return f"{self.mode} {'sharing' if self.sharing else 'no sharing'}"


def _key_bytes(s: Sizes, tokens: int) -> int:
    """GPU bytes of the index keys of `tokens` tokens (every layer)."""
    return s.e2e().num_layers * tokens * INDEX_FORMATS[s.index_format].key_bytes


def capacity_runs(s: Sizes) -> list[Capacity]:
    """Service mode without and with sharing, and the baseline, at the same budget."""
    e, P, C = s.e2e(), s.page_size, s.context
    if s.shared % P or s.shared >= C:
        raise ValueError(f"shared prefix {s.shared} must be a multiple of {P} below {C}")
    slot = e2e_plan.hisparse_request_bytes(e, C, s.hot_slots) - _key_bytes(s, C)
    plain = s.gpu_kv_bytes // (slot + _key_bytes(s, C))
    shared = (s.gpu_kv_bytes - _key_bytes(s, s.shared)) // (slot + _key_bytes(s, C - s.shared))
    base = s.gpu_kv_bytes // e2e_plan.baseline_request_bytes(e, C)
    if min(plain, shared, base) < 1:
        raise ValueError(f"budget {s.gpu_kv_bytes} B holds no request of {C} tokens")
    ppr = -(-C // P)
    new = max(plain, shared, base) + s.steady_steps  # every stream runs for steady_steps
    return [
        Capacity("service", False, plain, plain * ppr, new),
        Capacity("service", True, shared, shared * (ppr - s.shared // P) + s.shared // P, new),
        Capacity("baseline", False, base, base * ppr, new),
    ]


def topk_flags(source: str) -> list[str]:
    """The engine's top-k source as bench.e2e runs it: the replayed trace (~86% hits at B = 2k)
    or the random model's own indexer (~13%, the worst case)."""
    if source not in ("trace", "indexer"):
        raise ValueError(f"top-k source must be trace or indexer, got {source!r}")
    return ["--topk-source", TRACE_SOURCE if source == "trace" else "indexer"]


def ttft_cases(s: Sizes) -> dict[str, int]:
    """Shared prefix length per TTFT case: `shared` (past the hot buffer: an offloaded request,
    whose admission copies W cached rows) and the longest whole number of prefill chunks whose
    prompt stays resident (its admission copies every cached row into the hot buffer)."""
    resident = (s.hot_slots - s.ttft_suffix - 4) // s.prefill_chunk * s.prefill_chunk
    return (
        {"offloaded": s.shared, "resident": resident} if resident > 0 else {"offloaded": s.shared}
    )


def synthetic_tokens(s: Sizes, runs: list[Capacity]) -> int:
    """Synthetic context of every capacity request: room for the prompt and the longest run."""
    n = s.context - s.prompt_len - max(r.new_tokens for r in runs)
    if n < s.shared:
        raise ValueError(f"context {s.context} leaves {n} synthetic tokens < shared {s.shared}")
    return n


def layout(s: Sizes, slots: int, pages: int, max_context: int) -> LocalLayout:
    return LocalLayout(
        max_requests=slots,
        hot_slots=s.hot_slots,
        window=s.window,
        page_size=s.page_size,
        num_pages=pages,
        max_context=max_context,
        index_format=s.index_format,
        row_format=s.row_format,
    )


def service_flags(s: Sizes, lay: LocalLayout) -> list[str]:
    e = s.e2e()
    return flags.to_flags(lay.layout(e.num_layers, e.topk))


def engine_flags(s: Sizes, mode: str, lay: LocalLayout, sharing: bool, extra: list[str]) -> list:
    cache = ["--prefix-cache", "1" if sharing else "0"]
    if s.admission_limit != "auto":
        cache += ["--admission-limit", s.admission_limit]
    argv = engine_argv(s.preset, lay.max_requests, s.prefill_chunk, cache) + extra
    if mode == "baseline":
        argv += local_kv(s.device, lay)
    return argv
