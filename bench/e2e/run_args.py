"""The arguments of bench.e2e's children for one run: the engine's and, in the service modes, the
service's (its layout). Both are recorded in the run's JSON."""

from __future__ import annotations

from bench.e2e.plan import Run, Sizes
from bench.shared.child import engine_argv, local_kv
from contract import flags
from engine_client.serve.settings.local_layout import LocalLayout

TRACE_SOURCE = "bench.shared.trace:trace_source"


def local_layout(s: Sizes, run: Run) -> LocalLayout:
    """The run's KV memory: the engine's own (baseline/embedded) or, with the model's layers
    and top-k, the service's (whose layout the engine then adopts)."""
    baseline = run.mode == "baseline"
    return LocalLayout(
        max_requests=run.slots,
        # The baseline keeps every row on the GPU: its layout only has to be valid.
        hot_slots=max(run.hot_slots, s.window + s.topk) if baseline else run.hot_slots,
        window=s.window,
        page_size=s.page_size,
        num_pages=run.slots * run.max_context // s.page_size,
        max_context=run.max_context,
        index_format=s.index_format,
        row_format=s.row_format,
        host_reads=s.host_reads and not baseline,
    )


def service_flags(s: Sizes, run: Run) -> list[str]:
    """The service's layout; a speculative run's holds the MTP layer's KV as one more layer."""
    layers = s.num_layers + (1 if run.draft_tokens else 0)
    return flags.to_flags(local_layout(s, run).layout(layers, s.topk))


def engine_flags(s: Sizes, run: Run) -> list[str]:
    source = TRACE_SOURCE if run.source == "trace" else "indexer"
    if run.source == "trace" and s.trace_json:
        source += ":" + s.trace_json
    run_flags = ["--synthetic-context", str(run.context), "--topk-source", source]
    argv = engine_argv(s.preset, run.slots, s.prompt_len, run_flags)
    if s.layers:
        argv += ["--num-layers", str(s.layers)]
    if run.mode in ("baseline", "embedded"):
        argv += local_kv(s.device, local_layout(s, run))
    if run.mode in ("embedded", "service"):  # always: 1 must turn the engine's default (2) off
        argv += ["--decode-microbatches", str(s.decode_microbatches)]
    if run.draft_tokens:
        argv += ["--speculative", "mtp", "--draft-tokens", str(run.draft_tokens)]
    if run.acceptance:  # BENCHMARK-ONLY: the engine refuses it without the explicit flag
        argv += ["--speculative-acceptance", ",".join(str(r) for r in run.acceptance)]
        argv += ["--speculative-acceptance-seed", str(run.acceptance_seed)]
        argv += ["--allow-benchmark-only", "1"]
    if not run.overlap:
        argv += ["--overlap", "0"]
    if run.batch_invariant:
        argv += ["--batch-invariant", "1"]
    if s.decode_part_tail:
        argv += ["--decode-part-tail", "1"]
    if s.late_queries:
        argv += ["--decode-late-queries", "1"]
    if s.copy_priority and run.mode in ("embedded", "service"):
        argv += ["--decode-copy-priority", str(s.copy_priority)]
    if s.copy_grid and run.mode in ("embedded", "service"):
        argv += ["--decode-copy-grid", s.copy_grid]
    if s.admission_limit != "auto":
        argv += ["--admission-limit", s.admission_limit]
    return argv
