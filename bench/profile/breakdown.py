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

import argparse
import json
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench.profile.parts import (
    charged_name,
    families_us,
    per_step,
    print_families,
)
from bench.profile.step import Stepper, build, misses_so_far, step_seconds, sync
from bench.shared.attention_args import add_attention_args, mix_override
from bench.shared.copy_args import add_copy_args
from bench.shared.indexer_args import add_indexer_args
from bench.shared.kernel_names import CATEGORIES, OTHER, category, kernel_kind


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--layers", type=int, default=0, help="layers [the preset's]")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--mode", choices=("baseline", "embedded"), default="embedded")
    ap.add_argument("--topk-source", choices=("trace", "indexer"), default="trace")
    ap.add_argument("--row-format", choices=("bf16", "fp8"), default="bf16", help="KV rows")
    ap.add_argument(
        "--hot-slots", type=int, default=0, help="B [2 x top-k]; below W + k: host reads"
    )
    ap.add_argument("--window", type=int, default=0, help="W [min(128, top-k / 2)]")
    ap.add_argument("--page-size", type=int, default=64)
    _add_prefix_args(ap)
    ap.add_argument("--warmup", type=int, default=24, help="steps before timing")
    ap.add_argument("--steps", type=int, default=5, help="steps timed, and steps profiled")
    ap.add_argument("--device", default="auto")
    _add_part_args(ap)
    _add_kernel_args(ap)
    ap.add_argument("--no-ceilings", action="store_true", help="skip the pinned-copy measurement")
    ap.add_argument(
        "--no-families",
        action="store_true",
        help="skip the eager pass that charges each kernel to the model part that launched it",
    )
    ap.add_argument("--out", default="", help="JSON path [none]")
    args = ap.parse_args(argv)
    _check_prefix(ap, args)
    _check_mix(ap, args)
    return args


def _add_kernel_args(ap: argparse.ArgumentParser) -> None:
    """Which kernels, and the launch options of the miss copy, the attention and the indexer."""
    ap.add_argument(
        "--kernels",
        choices=("auto", "triton", "reference"),
        default="auto",
        help="auto: Triton on CUDA, the torch references on CPU",
    )
    add_copy_args(ap)
    add_attention_args(ap)
    add_indexer_args(ap)


def _check_mix(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.attn_mix:
        try:
            mix_override(args.attn_mix)
        except ValueError as e:
            ap.error(str(e))


def _add_prefix_args(ap: argparse.ArgumentParser) -> None:
    """A cached prefix common to every request, and the shared hot region that holds its rows."""
    ap.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        help="embedded: the first tokens of every context are one cached prefix (whole pages, "
        "shared by all requests, as bench.prefix's capacity runs) [0: none]",
    )
    ap.add_argument(
        "--shared-slots",
        type=int,
        default=0,
        help="embedded: the shared hot region's slots per layer (a multiple of B; the "
        "service's --shared-slots), read for the shared prefix's rows [0: none]",
    )


def _check_prefix(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not (args.shared_prefix or args.shared_slots):
        return
    if args.mode != "embedded":
        ap.error("--shared-prefix and --shared-slots profile the embedded mode")
    P = args.page_size
    if args.shared_prefix % P or not 0 <= args.shared_prefix < args.context:
        ap.error(f"--shared-prefix: whole pages of {P} below --context, got {args.shared_prefix}")
    if args.shared_slots and not args.shared_prefix:
        ap.error("--shared-slots needs --shared-prefix (the region holds only its rows)")


def _add_part_args(ap: argparse.ArgumentParser) -> None:
    """The decode step's micro-batches, and whether each part runs its own layer tail."""
    ap.add_argument(
        "--microbatches",
        type=int,
        default=1,
        help="embedded: decode parts whose "
        "miss copy overlaps the other parts' compute (side stream) [1: off]",
    )
    ap.add_argument(
        "--decode-part-tail",
        action="store_true",
        help="each micro-batch part runs its layer tail (o_proj, MLP) right after its attention "
        "(the engine's --decode-part-tail 1; Model.tail_parts = --microbatches)",
    )


# Categories whose kernels are also reported one by one (the shared phase is four launches).
BY_KERNEL = ("plan: shared phase",)


def profiled_us(
    step: Stepper,
    n: int,
    device: torch.device,
    kinds: dict[str, float] | None = None,
    named: dict[str, float] | None = None,
) -> dict[str, float]:
    """µs per category summed over n steps: device kernels on CUDA; on CPU each op's self
    time, charged to the innermost kernel:: range it runs in. `kinds` gets the "other"
    kernels' µs by PyTorch kernel kind (bench/profile/parts.py)."""
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    with profile(activities=acts) as prof:
        step(n)
        sync(device)
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
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
    before, kinds, named = misses_so_far(backend), {}, {}
    by_cat = profiled_us(step, args.steps, dev, kinds, named)
    traced = "graph replay" if runner.use_graphs else "eager"
    if runner.use_graphs and sum(by_cat.values()) < 0.01 * 1e6 * step_s * args.steps:
        # This profiler build did not trace the kernels inside graph replays: profile the
        # same step eagerly (same kernels; launch gaps differ, the step time stays graphed).
        runner.use_graphs, traced = False, "eager (graph kernels not traced)"
        before, kinds, named = misses_so_far(backend), {}, {}
        by_cat = profiled_us(step, args.steps, dev, kinds, named)
    miss_rows = (misses_so_far(backend) - before) / args.steps
    r = report(args, cfg, lay, step_s, by_cat, miss_rows, h2d)
    r["profiled"] = traced
    # Slots over all layers holding a shared-prefix row that can still hit (a host sync); a
    # region exists only with --shared-slots, which _check_prefix allows in embedded mode only.
    r["shared_rows_live"] = backend.kv.shared.live(lay.page_size) if args.shared_slots else None
    r["other_kinds"] = per_step(kinds, args.steps, r["step_us"])
    r["by_kernel"] = per_step(named, args.steps, r["step_us"])
    if not args.no_families:
        fams = families_us(step, runner, args.steps, dev)
        r["families"] = per_step(fams, args.steps, r["step_us"])
    print_report(r)
    print_families(r)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
