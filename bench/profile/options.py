"""bench.profile's flags: the step's shape (preset, context, batch, KV mode, row format), the
kernels' launch options (attention, indexer, miss copy), a shared prefix and micro-batch parts;
checked here, so the profile and its copy sweep refuse a bad combination before building."""

from __future__ import annotations

import argparse

from bench.shared.attention_args import add_attention_args, mix_override
from bench.shared.copy_args import add_copy_args
from bench.shared.glue_args import add_glue_args
from bench.shared.indexer_args import add_indexer_args


def parse_args(argv: list[str] | None = None, description: str = "") -> argparse.Namespace:
    """description: the --help text (bench.profile's module doc)."""
    ap = argparse.ArgumentParser(
        description=description or __doc__, formatter_class=argparse.RawDescriptionHelpFormatter
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
    add_glue_args(ap)


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
    ap.add_argument(
        "--late-queries",
        action="store_true",
        help="launch each layer's attention queries (q_b_proj, W_UK, q_pe's RoPE) after every "
        "part's swap-in plan, beside the miss copies (Model.late_queries; same bits)",
    )
