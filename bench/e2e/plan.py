"""What bench/e2e/cli.py runs: sizes, the equal-GPU-KV-budget sizing of every KV mode, and the run
matrix (one run = one engine process, with its phases of concurrent streams).

Budget G (bytes of GPU memory for KV state) is the same for every mode:
- baseline: full KV rows [L, C, D] + index keys [L, C, I] per request slot;
- HiSparse (embedded / service / service-remote-swap): hot buffers [L, B, D], index keys
  [L, C, I] (every page a request reserves has its keys on the GPU), residency state
  (token_slot [L, C], slot_token [L, B], lru_order [L, B - W] int32), page table, mode, hit flags.
Max concurrent requests of a mode = floor(G / per-request bytes). Index keys are fp8 (132 B);
rows D are bf16 (1152 B) or fp8 (656 B, `Sizes.row_format`), the same in every mode of a run.
C is the largest request any phase makes (synthetic context + prompt + new tokens), page-rounded.
With `mtp_layers` (bench/mtp/cli.py) every mode also holds the MTP layer's KV: L + 1 layers.
"""

from __future__ import annotations

from dataclasses import dataclass

from contract.layout import INDEX_FORMATS, ROW_FORMATS
from engine_client.model.preset import preset

HISPARSE_MODES = ("embedded", "service", "service-remote-swap")
MODES = ("baseline",) + HISPARSE_MODES


@dataclass(frozen=True)
class Sizes:
    """Everything a run is sized from (see bench/e2e/cli.py --help for each)."""

    preset: str
    contexts: tuple[int, ...]
    gpu_kv_bytes: int
    hot_slots: int
    window: int
    page_size: int
    prompt_len: int
    steady_steps: int
    batch1_tokens: int
    device: str
    sweep_requests: int
    sweep_factors: tuple[int, ...] = (1, 4)
    index_format: str = "fp8"
    row_format: str = "bf16"
    decode_microbatches: int = 2  # embedded/service engines: copy/compute overlap parts
    mtp_layers: int = 0  # sized with the MTP layer's KV (speculative runs, bench/mtp/cli.py)
    trace_json: str = ""  # TraceParams of the trace top-k source as JSON ("": defaults)
    extra_tokens: int = 0  # reserved past the last token (speculative steps' rows)
    # Tokens a step yields per request at most (speculative: D + 1): a phase's streams run
    # that many times more tokens, so its steady window still spans steady_steps steps.
    tokens_per_step: int = 1
    admission_limit: str = "auto"  # the engines' --admission-limit (off: the old behaviour)
    decode_part_tail: bool = False  # every mode's --decode-part-tail (the model splits alike)
    late_queries: bool = False  # every mode's --decode-late-queries (the same bits either way)
    copy_priority: int = 0  # the HiSparse engines' --decode-copy-priority (their copy stream)
    copy_grid: str = ""  # the HiSparse engines' --decode-copy-grid ("": their default launch)
    layers: int = 0  # the model's decoder layers (the engines' --num-layers); 0: the preset's
    # The HiSparse layouts' host_reads (issue 40): hot_slots may be below W + k (G k with
    # speculative rows); the misses past the victims are read from the host tier.
    host_reads: bool = False

    @property
    def num_layers(self) -> int:
        return self.layers or preset(self.preset).num_layers

    @property
    def kv_layers(self) -> int:
        return self.num_layers + self.mtp_layers

    @property
    def topk(self) -> int:
        return preset(self.preset).topk

    @property
    def vocab(self) -> int:
        return preset(self.preset).vocab_size


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def baseline_request_bytes(s: Sizes, max_context: int) -> int:
    ctx = _round_up(max_context, s.page_size)
    return (
        s.kv_layers
        * ctx
        * (ROW_FORMATS[s.row_format].row_bytes + INDEX_FORMATS[s.index_format].key_bytes)
    )


def hisparse_request_bytes(s: Sizes, max_context: int, hot_slots: int) -> int:
    L, B, W = s.kv_layers, hot_slots, s.window
    ctx = _round_up(max_context, s.page_size)
    hot = L * B * ROW_FORMATS[s.row_format].row_bytes
    index = L * ctx * INDEX_FORMATS[s.index_format].key_bytes
    residency = 4 * L * (max_context + B + (B - W))
    return hot + index + residency + 4 * (ctx // s.page_size) + 4 + B


@dataclass(frozen=True)
class ContextPlan:
    """Sizing of one context length: request slots per mode in the same budget G."""

    context: int
    max_context: int
    n_baseline: int
    n_hisparse: int
    baseline_bytes: int
    hisparse_bytes: int

    def host_tier_bytes(self, s: Sizes) -> int:
        pages = self.n_hisparse * self.max_context // s.page_size
        return pages * s.kv_layers * s.page_size * ROW_FORMATS[s.row_format].row_bytes

    def to_dict(self, s: Sizes) -> dict:
        return {
            "context": self.context,
            "max_context": self.max_context,
            "gpu_kv_budget_bytes": s.gpu_kv_bytes,
            "baseline": {
                "max_requests": self.n_baseline,
                "bytes_per_request": self.baseline_bytes,
                "gpu_kv_bytes": self.n_baseline * self.baseline_bytes,
            },
            "hisparse": {
                "max_requests": self.n_hisparse,
                "bytes_per_request": self.hisparse_bytes,
                "gpu_kv_bytes": self.n_hisparse * self.hisparse_bytes,
                "host_tier_bytes": self.host_tier_bytes(s),
            },
            "capacity_ratio": self.n_hisparse / max(self.n_baseline, 1),
        }


def plan_context(s: Sizes, context: int) -> ContextPlan:
    """Fixed point: C must hold the longest phase (n_hisparse + steady steps new tokens), and
    n_hisparse shrinks as C grows, so two passes settle it."""
    first = context + s.prompt_len + s.extra_tokens
    max_ctx = _round_up(first + s.steady_steps + s.batch1_tokens, s.page_size)
    for _ in range(3):
        n_hs = s.gpu_kv_bytes // hisparse_request_bytes(s, max_ctx, s.hot_slots)
        longest = max((n_hs + s.steady_steps) * s.tokens_per_step, s.batch1_tokens)
        max_ctx = _round_up(first + longest, s.page_size)
    n_hs = s.gpu_kv_bytes // hisparse_request_bytes(s, max_ctx, s.hot_slots)
    n_base = s.gpu_kv_bytes // baseline_request_bytes(s, max_ctx)
    if n_base < 1 or n_hs < 1:
        raise ValueError(f"budget {s.gpu_kv_bytes} B holds no request of {max_ctx} tokens")
    return ContextPlan(
        context,
        max_ctx,
        n_base,
        n_hs,
        baseline_request_bytes(s, max_ctx),
        hisparse_request_bytes(s, max_ctx, s.hot_slots),
    )


@dataclass(frozen=True)
class Phase:
    """`concurrency` streams at once, each generating `new_tokens` (ramp + steady state)."""

    name: str
    concurrency: int
    new_tokens: int


@dataclass(frozen=True)
class Run:
    """One engine process (and its service, for the service modes) and its phases."""

    context: int
    mode: str
    source: str
    phases: tuple[Phase, ...]
    slots: int
    hot_slots: int
    max_context: int
    tag: str = "main"
    # Speculative decoding (bench/mtp/cli.py): drafts per step (0: off), and the BENCHMARK-ONLY
    # synthetic acceptance rates per draft position and their seed (empty: real acceptance).
    draft_tokens: int = 0
    acceptance: tuple[float, ...] = ()
    acceptance_seed: int = 0
    overlap: bool = True  # False: the engine waits for every step (--overlap 0)
    batch_invariant: bool = False  # the engine's --batch-invariant (bench/mtp/cli.py)

    @property
    def label(self) -> str:
        tag = "" if self.tag == "main" else " " + self.tag
        mtp = f" mtp D={self.draft_tokens}" if self.draft_tokens else ""
        if self.acceptance:
            mtp += " synthetic " + ",".join(f"{r:g}" for r in self.acceptance)
        bi = " batch-invariant" if self.batch_invariant else ""
        return f"{self.context} {self.mode} {self.source}{mtp}{bi}{tag}"


def _phases(s: Sizes, names: tuple[str, ...], n_eq: int, n_max: int) -> tuple[Phase, ...]:
    table = {
        "batch1": Phase("batch1", 1, s.batch1_tokens),
        "equal": Phase("equal", n_eq, n_eq + s.steady_steps),
        "max": Phase("max", n_max, n_max + s.steady_steps),
    }
    return tuple(table[n] for n in names)


def _phase_names(mode: str, source: str) -> tuple[str, ...]:
    if source != "trace":  # the random model's own indexer: the capacity point only
        return ("max",) if mode in ("baseline", "service") else ()
    return {"baseline": ("batch1", "max"), "service-remote-swap": ("batch1", "equal")}.get(
        mode, ("batch1", "equal", "max")
    )


def build_matrix(s: Sizes, modes: tuple[str, ...], sources: tuple[str, ...]) -> list[Run]:
    """Per context: the trace source in every mode, then the indexer source; the service modes
    of a context sit next to each other so they share one kv_service process. Then the
    hit-rate-vs-B sweep. A time budget cuts the list from the end."""
    runs: list[Run] = []
    plans = {c: plan_context(s, c) for c in s.contexts}
    for c, p in plans.items():
        order = [(m, src) for src in sources for m in modes]
        # Service-mode runs of both sources back to back (one service), baseline-indexer last.
        order.sort(key=lambda ms: (ms[1] != "trace" and ms[0] == "baseline",))
        for mode, source in order:
            names = _phase_names(mode, source)
            n = p.n_baseline if mode == "baseline" else p.n_hisparse
            if names:
                runs.append(
                    Run(
                        c,
                        mode,
                        source,
                        _phases(s, names, min(p.n_baseline, n), n),
                        n,
                        s.hot_slots,
                        p.max_context,
                    )
                )
    if "trace" in sources and s.sweep_factors:
        runs += sweep_runs(s, plans[s.contexts[0]])
    return runs


def sweep_runs(s: Sizes, p: ContextPlan) -> list[Run]:
    """Hit rate vs B: embedded runs at LRU capacity f * k (B = f * k + W), few requests."""
    n = min(s.sweep_requests, p.n_hisparse)
    return [
        Run(
            p.context,
            "embedded",
            "trace",
            (Phase("sweep", n, n + s.steady_steps),),
            n,
            f * s.topk + s.window,
            p.max_context,
            tag=f"B={f * s.topk + s.window}",
        )
        for f in s.sweep_factors
    ]
