"""bench.disagg's options (`parse_args`), and what they give a run: its topologies, the
prefill engines' GPUs, every engine's speculative flags and the KV service's layout."""

from __future__ import annotations

import argparse

from contract.layout import KVLayout
from engine_client.loop.speculative import reserve_extra
from engine_client.model.preset import preset


def parse_args(argv: list[str] | None, description: str = "") -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny preset, 1x1, 3 streams")
    ap.add_argument("--preset", default="bench")
    _add_load_args(ap)
    _add_engine_args(ap)
    ap.add_argument("--no-colocated", action="store_true", help="skip the role-both baseline")
    ap.add_argument("--out", default="", help="JSON path [bench/results/disagg-<date>.json]")
    args = ap.parse_args(argv)
    if args.smoke:
        args.preset, args.prompt, args.streams, args.tokens = "tiny", 40, 2, 24
        args.arrivals, args.arrival_tokens, args.interval = 2, 4, 0.05
        args.prefill_batch, args.prefill_chunk, args.page_size = 2, 32, 16
        args.hot_slots, args.window, args.topologies = 32, 8, "1x1"
    return args


def _add_load_args(ap: argparse.ArgumentParser) -> None:
    """The decode side's load: background streams at max N, prompts arriving meanwhile."""
    ap.add_argument("--prompt", type=int, default=8192, help="prompt tokens per stream")
    ap.add_argument("--streams", type=int, default=32, help="background streams (max N)")
    ap.add_argument(
        "--tokens",
        type=int,
        default=2048,
        help="most tokens per background stream (each stops where the arrivals' window ends)",
    )
    ap.add_argument("--arrivals", type=int, default=16, help="prompts arriving meanwhile")
    ap.add_argument("--arrival-tokens", type=int, default=8, help="tokens per arrival")
    ap.add_argument("--interval", type=float, default=0.1, help="seconds between arrivals")


def _add_engine_args(ap: argparse.ArgumentParser) -> None:
    """The runs' processes: topologies, transfer sources, formats, layout, speculation, GPUs."""
    ap.add_argument("--topologies", default="1x1", help="PxD runs, comma-separated (2x2: ...)")
    ap.add_argument("--sources", default="auto", help="--transfer-source values to run")
    ap.add_argument("--row-format", default="bf16", help="row and index-key format")
    ap.add_argument("--prefill-batch", type=int, default=4, help="prompts per prefill engine")
    ap.add_argument("--prefill-chunk", type=int, default=2048)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--hot-slots", type=int, default=4096)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument(
        "--draft-tokens",
        type=int,
        default=0,
        help="every engine runs --speculative mtp with D drafts (the prefill engines send their "
        "drafts to the decode side; the layout gains the MTP layer) [0: off]",
    )
    ap.add_argument(
        "--speculative-acceptance",
        default="0.9",
        help="BENCHMARK-ONLY synthetic acceptance rates of the drafts, as the engine's flag "
        "(V3.2's published D = 1 rate by default); used with --draft-tokens",
    )
    ap.add_argument(
        "--prefill-gpus",
        default="",
        help="CUDA device indices for the prefill engines, round-robin (e.g. 1 or 1,2): "
        "prefill on GPUs of its own, the service and decode engines on GPU 0; empty: all on one",
    )


def topologies(text: str) -> list[tuple[int, int]]:
    """'1x1,2x2' -> [(1, 1), (2, 2)]."""
    out = []
    for item in text.split(","):
        p, d = item.strip().lower().split("x")
        out.append((int(p), int(d)))
    return out


def prefill_gpus(text: str, count: int | None = None) -> tuple[int, ...]:
    """'1,2' -> (1, 2); each index must name one of `count` GPUs (when given)."""
    gpus = tuple(int(g) for g in text.split(",") if g.strip())
    if count is not None and any(not 0 <= g < count for g in gpus):
        raise SystemExit(f"--prefill-gpus {text}: this machine has {count} GPU(s)")
    return gpus


def speculation(args: argparse.Namespace) -> tuple[str, ...]:
    """Every engine's speculative flags (none without --draft-tokens)."""
    if not args.draft_tokens:
        return ()
    return (
        *("--speculative", "mtp", "--draft-tokens", str(args.draft_tokens)),
        *("--speculative-acceptance", args.speculative_acceptance, "--allow-benchmark-only", "1"),
    )


def layout(args: argparse.Namespace) -> KVLayout:
    """The service's layout: every stream's and arrival's context at once; speculative, the MTP
    layer's KV as one more layer, the verify rows' union of top-k within B - W and the rows a
    verify step may write past the last token reserved."""
    cfg, page, requests = preset(args.preset), args.page_size, args.streams + args.arrivals
    d = args.draft_tokens
    tokens = max(args.tokens, args.arrival_tokens) + (reserve_extra(d) if d else 0)
    max_context = -(-(args.prompt + tokens + page) // page) * page
    return KVLayout(
        num_layers=cfg.num_layers + (1 if d else 0),
        max_requests=requests,
        hot_slots=max(args.hot_slots, args.window + cfg.topk * (d + 1)),
        window=args.window,
        topk=cfg.topk,
        page_size=page,
        num_pages=requests * max_context // page,
        max_context=max_context,
        row_format=args.row_format,
        index_format=args.row_format,
    )
