"""What bench/prefix/cli.py runs: sizes, and the sizing of each run at one GPU KV budget G.

The service's runs are sized by contract.capacity.fit, the device bytes of the very layout the
service allocates: per request slot the hot buffer, residency state and page-table row, plus the
index keys of every page in the pool. Without sharing every request holds `context` tokens of
pages; with sharing the `shared` prefix's pages are held once; with shared hot rows too
(`shared_slots` > 0) the prefix's rows live once in the region of S slots per layer, and each
request's private buffer is `private_hot_slots` rows (at least W + k) instead of B:
    R x (slot bytes + (context - shared) tokens of keys) + shared tokens of keys + region <= G.
The baseline's paged cache holds R x context tokens of rows and keys (its pool is sized by its
request slots, so sharing saves it prefill compute, not capacity).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from bench.e2e import plan as e2e_plan
from bench.e2e.run_args import TRACE_SOURCE
from bench.shared.child import engine_argv, local_kv
from contract import capacity, flags
from contract.layout import KVLayout, needs_host_reads, request_slots
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
    reuse_pages: bool = True  # the engines' --prefix-reuse-pages (reuse to the page)
    # The capacity part's run with shared hot rows: its region (S slots per layer; 0: no such
    # run) and each request's private hot buffer there.
    shared_slots: int = 0
    private_hot_slots: int = 0
    capacity_runs: tuple[str, ...] = ("plain", "sharing", "slots", "baseline")  # CAPACITY_RUNS

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


# The capacity part's runs, by name: service without sharing, with sharing, with sharing and
# shared hot rows (when Sizes.shared_slots), and the all-on-GPU baseline.
CAPACITY_RUNS = ("plain", "sharing", "slots", "baseline")


@dataclass(frozen=True)
class Capacity:
    """One capacity run: `slots` concurrent requests of `context` tokens in budget G, each with
    a private hot buffer of `hot_slots` rows, beside a region of `shared_slots` (0: none)."""

    mode: str
    sharing: bool
    slots: int
    pages: int
    new_tokens: int
    hot_slots: int = 0
    shared_slots: int = 0

    @property
    def label(self) -> str:
        label = f"{self.mode} {'sharing' if self.sharing else 'no sharing'}"
        return label + (f" + {self.shared_slots} shared slots" if self.shared_slots else "")


def _service_runs(s: Sizes) -> list[tuple[bool, KVLayout]]:
    """(sharing, layout) of each service run, fitted to the budget (contract.capacity)."""
    e, C = s.e2e(), s.context
    template = KVLayout(
        num_layers=e.kv_layers, max_requests=1, hot_slots=s.hot_slots, window=s.window,
        topk=e.topk, page_size=s.page_size, num_pages=1, max_context=C,
        row_format=s.row_format, index_format=s.index_format,
    )  # fmt: skip
    shared = capacity.Workload(C, s.shared)
    runs = [(False, capacity.Workload(C)), (True, shared)]
    out = [(sharing, capacity.fit(template, w, s.gpu_kv_bytes)) for sharing, w in runs]
    if s.shared_slots:
        B, S = s.private_hot_slots, s.shared_slots
        # A private buffer below W + k reads its misses past the victims from the host tier.
        reads = needs_host_reads(B, s.window, e.topk)
        small = dataclasses.replace(
            template, hot_slots=B, shared_slots=S, max_requests=S // B + 1, host_reads=reads
        )
        out.append((True, capacity.fit(small, shared, s.gpu_kv_bytes)))
    return out


def capacity_runs(s: Sizes) -> list[Capacity]:
    """Service mode without and with sharing (and with shared hot rows, if asked), and the
    baseline, at the same budget."""
    e, P, C = s.e2e(), s.page_size, s.context
    if s.shared % P or s.shared >= C:
        raise ValueError(f"shared prefix {s.shared} must be a multiple of {P} below {C}")
    unknown = set(s.capacity_runs) - set(CAPACITY_RUNS)
    if unknown:
        raise ValueError(f"capacity runs {sorted(unknown)} are not among {CAPACITY_RUNS}")
    service = _service_runs(s)
    base = s.gpu_kv_bytes // e2e_plan.baseline_request_bytes(e, C)
    if base < 1:
        raise ValueError(f"budget {s.gpu_kv_bytes} B holds no request of {C} tokens")
    sized = [(sharing, lay, request_slots(lay)) for sharing, lay in service]
    named = dict(zip(CAPACITY_RUNS, [*sized, (False, None, base)]))
    chosen = {k: v for k, v in named.items() if k in s.capacity_runs}
    new = max(n for *_, n in chosen.values()) + s.steady_steps  # every stream: steady_steps
    return [
        Capacity("baseline", False, n, n * -(-C // P), new, s.hot_slots)
        if lay is None
        else Capacity("service", sharing, n, lay.num_pages, new, lay.hot_slots, lay.shared_slots)
        for sharing, lay, n in chosen.values()
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


def layout(
    s: Sizes, slots: int, pages: int, max_context: int, hot_slots: int = 0, shared_slots: int = 0
) -> LocalLayout:
    """`slots` request slots (the region's besides) of `hot_slots` rows (default: the sizes')."""
    B = hot_slots or s.hot_slots
    return LocalLayout(
        max_requests=slots + shared_slots // B,
        hot_slots=B,
        window=s.window,
        page_size=s.page_size,
        num_pages=pages,
        max_context=max_context,
        index_format=s.index_format,
        row_format=s.row_format,
        shared_slots=shared_slots,
        host_reads=needs_host_reads(B, s.window, s.e2e().topk),
    )


def capacity_layout(s: Sizes, r: Capacity) -> LocalLayout:
    return layout(s, r.slots, r.pages, s.context, r.hot_slots, r.shared_slots)


def service_flags(s: Sizes, lay: LocalLayout) -> list[str]:
    e = s.e2e()
    return flags.to_flags(lay.layout(e.num_layers, e.topk))


def engine_flags(s: Sizes, mode: str, lay: LocalLayout, sharing: bool, extra: list[str]) -> list:
    cache = ["--prefix-cache", "1" if sharing else "0"]
    if s.admission_limit != "auto":
        cache += ["--admission-limit", s.admission_limit]
    if sharing:
        cache += ["--prefix-reuse-pages", "1" if s.reuse_pages else "0"]
    requests = lay.max_requests - lay.shared_slots // lay.hot_slots  # the region's are not
    argv = engine_argv(s.preset, requests, s.prefill_chunk, cache) + extra
    if mode == "baseline":
        argv += local_kv(s.device, lay)
    return argv
