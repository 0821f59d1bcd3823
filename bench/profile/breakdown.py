"""Per-kernel breakdown of the decode step, by category (issue 16): the tool to find the next
bottleneck.

    python -m bench.profile --preset bench --context 32768 --batch 174 --mode embedded
    python -m bench.profile --preset tiny --context 64 --batch 2      # CPU smoke run

Builds the engine's model and KV backend at `batch` requests of `context` synthetic tokens (as
bench/profile/graph_step.py does), decodes `warmup` steps so the hot buffers reach their steady miss
rate, times `steps` steps, then profiles `steps` more with torch.profiler. On CUDA the step is
the captured graph and kernels are grouped by name; on CPU (eager) every kernel-set call is a
named range, and each op's self time goes to the range it runs in. Reported per category: µs per
step, share of the step, µs per request-layer; and the step's miss rows and the in-situ
miss-copy bandwidth against the same run's pinned copy. Top-k comes from the replayed trace
(bench/shared/trace.py, ~13% misses at B = 2k) unless --topk-source indexer. With --microbatches > 1
the miss copy runs on a side stream beside the other kernels, so shares can sum past 100%.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench.profile.options import parse_args
from bench.profile.parts import (
    charged_name,
    families_us,
    per_step,
    print_families,
)
from bench.profile.step import Stepper, build, misses_so_far, step_seconds, sync
from bench.profile.timeline import kernel_records, print_timeline, timeline
from bench.shared.kernel_names import CATEGORIES, OTHER, category, kernel_kind

# Categories whose kernels are also reported one by one (the shared phase is four launches).
BY_KERNEL = ("plan: shared phase",)


def profiled_us(
    step: Stepper,
    n: int,
    device: torch.device,
    kinds: dict[str, float] | None = None,
    named: dict[str, float] | None = None,
    spans: dict[str, float] | None = None,
) -> dict[str, float]:
    """µs per category summed over n steps: device kernels on CUDA; on CPU each op's self
    time, charged to the innermost kernel:: range it runs in. `kinds` gets the "other"
    kernels' µs by PyTorch kernel kind (bench/profile/parts.py); `spans` the device timeline
    a step on CUDA (bench/profile/timeline.py)."""
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    with profile(activities=acts) as prof:
        step(n)
        sync(device)
    if spans is not None and device.type == "cuda":
        spans.update(timeline(kernel_records(prof), n))
    out: dict[str, float] = {}
    for e in prof.events():
        if device.type == "cuda":
            if e.device_type != torch.autograd.DeviceType.CUDA:
                continue
            name, us = e.name, e.time_range.elapsed_us()
        else:
            name, us = charged_name(e), e.self_cpu_time_total
        cat = category(name)
        out[cat] = out.get(cat, 0.0) + us
        if cat == "other" and kinds is not None:
            kinds[kernel_kind(name)] = kinds.get(kernel_kind(name), 0.0) + us
        if cat in BY_KERNEL and named is not None:
            named[name] = named.get(name, 0.0) + us
    return out


def report(
    args, cfg, lay, step_s: float, by_cat: dict[str, float], miss_rows: float, h2d_gbs: float | None
) -> dict:
    """Per category: µs per step, share of the step, µs per request-layer (+ the miss copy's
    in-situ bandwidth). Shares are of the timed step; GPU busy time can be less (idle gaps)."""
    n, L, steps = args.batch, cfg.num_layers, args.steps
    step_us = 1e6 * step_s
    rows = {}
    for cat in [c for c, _ in CATEGORIES] + [OTHER]:
        us = by_cat.get(cat, 0.0) / steps
        rows[cat] = {"us_per_step": us, "share": us / step_us, "us_per_request_layer": us / (n * L)}
    busy = sum(by_cat.values()) / steps
    copy_us = rows["miss copy"]["us_per_step"]
    gbs = miss_rows * lay.row_bytes / copy_us / 1e3 if copy_us > 0 and miss_rows else None
    return {
        "args": vars(args),
        "device": _device_name(),
        "num_layers": L,
        "row_bytes": lay.row_bytes,
        "step_us": step_us,
        "busy_us_per_step": busy,
        "categories": rows,
        "miss_rows_per_step": miss_rows,
        "miss_rate": miss_rows / (n * L * min(cfg.topk, args.context)),
        "miss_copy_gbs": gbs,
        "pinned_h2d_gbs": h2d_gbs,
        "miss_copy_over_pinned": gbs / h2d_gbs if gbs and h2d_gbs else None,
    }


def _device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def print_report(r: dict) -> None:
    a = r["args"]
    print(
        f"\ndecode step profile: {r['device']}, preset {a['preset']} ({r['num_layers']} layers), "
        f"{a['mode']}, {a.get('row_format', 'bf16')} rows, context {a['context']}, "
        f"N {a['batch']}, top-k {a['topk_source']}"
        + (f", {a['microbatches']} micro-batches" if a.get("microbatches", 1) > 1 else "")
        + (", part tail" if a.get("decode_part_tail") else "")
        + (", late queries" if a.get("late_queries") else "")
        + (", PyTorch norm and RoPE" if a.get("torch_glue") else "")
        + (f", shared prefix {a['shared_prefix']}" if a.get("shared_prefix") else "")
        + (f" (region {a['shared_slots']} slots)" if a.get("shared_slots") else "")
    )
    print(
        f"step {r['step_us'] / 1e3:.3f} ms (timed), "
        f"kernels busy {r['busy_us_per_step'] / 1e3:.3f} ms "
        f"(profiled: {r.get('profiled', '?')})"
    )
    print(f"{'category':<18} {'us/step':>10} {'share':>6} {'us/req-layer':>13}")
    for cat, v in r["categories"].items():
        print(
            f"{cat:<18} {v['us_per_step']:>10.1f} {100 * v['share']:>5.1f}% "
            f"{v['us_per_request_layer']:>13.3f}"
        )
    gbs, pin = r["miss_copy_gbs"], r["pinned_h2d_gbs"]
    print(
        f"miss rows/step {r['miss_rows_per_step']:.0f} ({100 * r['miss_rate']:.1f}% of selected); "
        f"miss copy in situ "
        + ("-" if gbs is None else f"{gbs:.1f} GB/s")
        + (
            ""
            if not pin
            else f" vs pinned copy {pin:.1f} GB/s" + ("" if gbs is None else f" = {gbs / pin:.2f}")
        )
    )


def _profiled(step: Stepper, runner, backend, args, dev: torch.device, step_s: float) -> dict:
    """The profiled steps: µs by category, kind, named kernel; the device timeline; miss rows a
    step; and how the kernels were traced."""

    def once() -> dict:
        before, got = misses_so_far(backend), {"kinds": {}, "named": {}, "spans": {}}
        got["by_cat"] = profiled_us(step, args.steps, dev, got["kinds"], got["named"], got["spans"])
        return got | {"miss_rows": (misses_so_far(backend) - before) / args.steps}

    got, traced = once(), "graph replay" if runner.use_graphs else "eager"
    if runner.use_graphs and sum(got["by_cat"].values()) < 0.01 * 1e6 * step_s * args.steps:
        # This profiler build did not trace the kernels inside graph replays: profile the
        # same step eagerly (same kernels; launch gaps differ, the step time stays graphed).
        runner.use_graphs, traced = False, "eager (graph kernels not traced)"
        got = once()
    return got | {"traced": traced}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv, description=__doc__)
    dev = torch.device(
        args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    )
    h2d = None
    if dev.type == "cuda" and not args.no_ceilings:
        from bench.shared.timing import measure_ceilings

        h2d = measure_ceilings()["h2d_gbs"]
    cfg, lay, backend, runner = build(args, dev)
    step = Stepper(runner, args.batch, args.context)
    step(args.warmup)
    step_s = step_seconds(step, args.steps, dev)
    p = _profiled(step, runner, backend, args, dev, step_s)
    r = report(args, cfg, lay, step_s, p["by_cat"], p["miss_rows"], h2d)
    r["profiled"], r["timeline"] = p["traced"], p["spans"] or None
    # Slots over all layers holding a shared-prefix row that can still hit (a host sync); a
    # region exists only with --shared-slots, which _check_prefix allows in embedded mode only.
    r["shared_rows_live"] = backend.kv.shared.live(lay.page_size) if args.shared_slots else None
    r["other_kinds"] = per_step(p["kinds"], args.steps, r["step_us"])
    r["by_kernel"] = per_step(p["named"], args.steps, r["step_us"])
    if not args.no_families:
        fams = families_us(step, runner, args.steps, dev)
        r["families"] = per_step(fams, args.steps, r["step_us"])
    print_report(r)
    print_timeline(p["spans"])
    print_families(r)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
