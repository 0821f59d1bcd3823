"""bench.mtp's options past the sizes: how the engines step and size their hot buffers, the
synthetic acceptance rules per D, the default GPU KV budget; checked once, as the runs use
them (bench/mtp/cli.py parses)."""

from __future__ import annotations

import argparse

from contract.layout import MAX_DRAFT_TOKENS
from engine_client.loop.acceptance_rates import AcceptanceRates
from engine_client.model.preset import preset


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(t) for t in text.split(","))


def engine_options(ap: argparse.ArgumentParser) -> None:
    """How the engines of the runs step (overlapped or not, batch-invariant or not) and how
    service mode sizes its hot buffer (host reads or not)."""
    ap.add_argument(
        "--host-reads",
        type=int,
        default=0,
        choices=(0, 1),
        help="1: size service mode's hot buffer W + k, not W + k (D + 1), with the layout's "
        "host_reads (the verify union's misses past the victims are read from the host tier; "
        "issue 40): more requests at once; 0: every miss finds a victim [0]",
    )
    ap.add_argument(
        "--plain-overlap",
        type=int,
        default=1,
        help="1: the plain runs overlap steps (the engine as it serves); 0: they wait for every "
        "step, to separate the overlap's share of the difference",
    )
    ap.add_argument(
        "--mtp-overlap",
        type=int,
        default=1,
        help="1: the speculative runs overlap steps too (the engine as it serves); 0: they wait "
        "for every step (the engine before issue 41 item 3), the overlap's share for MTP",
    )
    ap.add_argument(
        "--batch-invariant",
        default="0",
        choices=("0", "1", "0,1"),
        help="the engine's --batch-invariant for every run; 0,1: each run both ways (its cost)",
    )


def checked(ap: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """The parsed values as the runs use them (ap.error on a bad one)."""
    args.batch_invariant = tuple(v == "1" for v in args.batch_invariant.split(","))
    try:
        args.draft_tokens = tuple(int(d) for d in args.draft_tokens.split(","))
        if not all(1 <= d <= MAX_DRAFT_TOKENS for d in args.draft_tokens):
            raise ValueError(f"--draft-tokens: each D in 1..{MAX_DRAFT_TOKENS}")
        rates = _floats(args.speculative_acceptance)
        if args.layers < 0:
            raise ValueError(f"--layers must be >= 0 (0: the preset's), got {args.layers}")
        if len(rates) > max(args.draft_tokens):
            raise ValueError(f"{len(rates)} rates for at most {max(args.draft_tokens)} drafts")
        args.rules = {d: rules_for(rates, d) for d in args.draft_tokens}
    except ValueError as e:
        ap.error(str(e))
    return args


def rules_for(rates: tuple[float, ...], d: int, seed: int = 0) -> AcceptanceRates:
    """The synthetic rule of a run at D = d: the first d rates (checked as the engine will)."""
    return AcceptanceRates(rates[:d], d, seed)


def default_kv_gib(smoke: bool, layers: int) -> float:
    """6 GiB for the bench preset's 4 layers and the MTP layer's KV, scaled with --layers (the
    same budget a KV layer, so N stays the 4-layer runs')."""
    if smoke:
        return 2 / 1024
    four = preset("bench").num_layers
    return 6.0 * ((layers or four) + 1) / (four + 1)
