"""The swap plan wrapper's argument checks (kernels/swap/plan.py): the sizes the plan needs and
every tensor's dtype, shape and contiguity, before anything is launched."""

from __future__ import annotations

import torch

from kernels.arg_specs import Specs, check_specs

# Rows one plan may share: a verify step's D + 1 rows, D <= 3 draft tokens.
MAX_ROWS_PER_REQUEST = 4
# The plan's positional tensors, in swap_plan's order.
PLAN_TENSORS = (
    "topk", "seq_lens", "req_slots", "req_mode", "page_table", "token_slot", "slot_token",
    "lru_order", "hit_flag", "out_slots", "out_miss_src", "out_miss_dst", "out_miss_count",
)  # fmt: skip


def check_sizes(
    layer: int, num_layers: int, shapes: dict[str, int], G: int, host_fallback: bool
) -> None:
    """shapes: bs, k, L, R, C, B, W, P, max_pages. Without host_fallback every miss of a
    request's G k entries must find a victim among the B - W LRU slots; with it, the ones that
    do not read their host row, and one LRU slot suffices (W < B)."""
    bs, k, L, B, W = (shapes[n] for n in ("bs", "k", "L", "B", "W"))
    if num_layers != L or not 0 <= layer < L:
        raise ValueError(f"layer {layer} / num_layers {num_layers} do not match token_slot {L}")
    if not 1 <= G <= MAX_ROWS_PER_REQUEST or bs % G:
        raise ValueError(
            f"rows_per_request must be in [1, {MAX_ROWS_PER_REQUEST}] and divide the batch "
            f"({bs} rows), got {G}"
        )
    fits = host_fallback or G * k <= B - W
    if not G <= W < B or not fits or shapes["max_pages"] * shapes["P"] < shapes["C"]:
        raise ValueError(
            f"need G <= W < B, G * k <= B - W (unless host_fallback), max_pages * P >= C: "
            f"G={G} W={W} B={B} k={k} max_pages={shapes['max_pages']} P={shapes['P']} "
            f"C={shapes['C']} host_fallback={host_fallback}"
        )


def check_tensors(
    tensors: tuple[torch.Tensor, ...],
    optional: dict[str, torch.Tensor | None],
    G: int,
    W: int,
) -> None:
    """tensors: PLAN_TENSORS; optional: out_miss_rows, out_counts, out_totals (None: absent)."""
    x = dict(zip(PLAN_TENSORS, tensors))
    (bs, k), (L, R, C), B = x["topk"].shape, x["token_slot"].shape, x["slot_token"].shape[2]
    n, i32, i64 = bs // G, torch.int32, torch.int64
    want = {
        "topk": (i32, (bs, k)),
        "seq_lens": (i32, (bs,)),
        "req_slots": (i32, (bs,)),
        "req_mode": (i32, (R,)),
        "page_table": (i32, (R, x["page_table"].shape[1])),
        "token_slot": (i32, (L, R, C)),
        "slot_token": (i32, (L, R, B)),
        "lru_order": (i32, (L, R, B - W)),
        "hit_flag": (torch.int8, (R, B)),
        "out_slots": (i32, (bs, k)),
        "out_miss_src": (i64, (n, G * k)),
        "out_miss_dst": (i64, (n, G * k)),
        "out_miss_count": (i32, (n,)),
        "out_miss_rows": (i32, (n,)),
        "out_counts": (i64, (R + 1, 3)),
        "out_totals": (i64, (2,)),
    }
    given = x | {name: t for name, t in optional.items() if t is not None}
    specs: Specs = {name: (t, *want[name]) for name, t in given.items()}
    check_specs(specs)
