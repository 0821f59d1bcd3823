"""Replayed top-k trace: a synthetic selection whose step-to-step reuse matches published miss
rates, so the HiSparse modes can be measured with realistic hit rates on a random-weight model
(whose own indexer picks nearly fresh tokens every step).

Target (SGLang HiSparse, GLM-5.1, k = 2048): about 30 / 13 / 7 % misses with B = k / 2k / 4k.
We calibrate against our plan semantics with LRU capacities k, 2k, 4k (B = capacity + window).

The generator is stateless, so a CUDA graph can replay it: the selection of (layer, request
slot, position t) is a hash of those numbers. Context [0, k * w) is cut into k stripes of width
w (a power of two <= seq_len / k, so it changes rarely); lane j picks one position in stripe j,
which makes the k positions distinct and ascending, as the top-k contract asks. Within an
epoch of `epoch` steps a lane sits on a home offset, or with probability `flicker` on one of
`alternates` other offsets of the epoch (tokens that drift in and out of the top-k: these are
what a larger B turns into hits); a new epoch draws fresh offsets (misses whatever B is). A
share `static` of the lanes never moves (attention sinks, key tokens).

    python -m bench.shared.trace --calibrate      # simulated miss rates at LRU capacity k, 2k, 4k
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np
import torch

TARGET_MISS = {1: 0.30, 2: 0.13, 4: 0.07}  # LRU capacity in units of k -> miss rate
_M32 = 0xFFFFFFFF


@dataclass(frozen=True)
class TraceParams:
    """epoch: steps between fresh draws of a lane; flicker: chance per step that a lane is off
    its home; alternates: offsets it flickers between; static: share of lanes that never move;
    per_slot: draw per request slot (False: every request selects alike at a position, so a
    request's selections, and tokens, do not depend on the slot it lands in: bench/mtp/cli.py
    replays tokens recorded by another run)."""

    epoch: int = 44
    flicker: float = 0.19
    alternates: int = 3
    static: float = 0.12
    seed: int = 0
    per_slot: bool = True


def _mix(x: torch.Tensor) -> torch.Tensor:
    """32-bit integer hash on int64 tensors (multipliers < 2^31, so products fit in int64)."""
    x = x & _M32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M32
    return x ^ (x >> 16)


class TraceTopk:
    """A top-k source for engine_client.model.model.Model.topk_source: overwrites the decode step's
    top-k [n, k] in place, on fixed shapes: capturable in a CUDA graph. `fused` (the default on
    CUDA): one Triton launch per call (bench/shared/trace_kernel.py); else the torch ops below,
    which are its reference."""

    def __init__(
        self,
        num_layers: int,
        topk: int,
        device: torch.device | str,
        params: TraceParams = TraceParams(),
    ) -> None:
        self.k, self.params, self.device = topk, params, torch.device(device)
        lanes = torch.arange(topk, dtype=torch.int64)
        layers = torch.arange(num_layers, dtype=torch.int64)[:, None]
        key = _mix(_mix(layers * 0x1F123BB5 + params.seed) + lanes * 0x2545F491)  # [L, k]
        self.lanes = lanes.to(self.device)
        self.key = key.to(self.device)
        self.phase = (_mix(key + 0x3C6EF372) % params.epoch).to(self.device)
        # Static lanes never flicker and keep one epoch for good.
        self.moving = (_mix(key + 0x5851F42D) % 1000 >= int(1000 * params.static)).to(self.device)
        self.fused = self.device.type == "cuda"

    def __call__(
        self, layer: int, req_slots: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor
    ) -> None:
        p = self.params
        if self.fused and out.dtype == torch.int32 and out.stride(1) == 1:
            from bench.shared.trace_kernel import trace_topk

            trace_topk(
                self.key[layer],
                self.phase[layer],
                self.moving[layer],
                req_slots,
                seq_lens,
                out,
                epoch=p.epoch,
                flicker=p.flicker,
                alternates=p.alternates,
                per_slot=p.per_slot,
            )
            return
        lens = seq_lens.long()[:, None].clamp(min=1)  # [n, 1]
        t = lens - 1
        ratio = (lens // self.k).clamp(min=1)
        # Largest power of two <= seq_len / k (exact for the int range used here).
        w = torch.exp2(torch.floor(torch.log2(ratio.double()))).long()
        slot = req_slots.long()[:, None].clamp(min=0) if p.per_slot else req_slots[:, None] * 0
        base = _mix(self.key[layer] + slot * 0x61C88647)
        moving = self.moving[layer]
        epoch = torch.where(moving, (t + self.phase[layer]) // p.epoch, 0)
        draw = _mix(base + t * 0x27D4EB2F)  # per step
        off_step = (draw & 0xFFFF) < int(65536 * p.flicker)
        alt = 1 + (draw >> 16) % p.alternates
        which = torch.where(moving & off_step, alt, 0)
        # Home and alternates are distinct offsets of the stripe, so w does not change the rates.
        h = _mix(base + epoch * 0x165667B1)
        stride = 1 + (h >> 8) % ((w - 1) // p.alternates).clamp(min=1)
        offset = (h + which * stride) % w
        pos = self.lanes * w + offset
        out.copy_(torch.where(pos < lens, pos, -1).to(out.dtype))


def trace_source(model_cfg, layout, device: str, **kwargs) -> TraceTopk:
    """Factory for `python -m engine_client serve --topk-source
    bench.shared.trace:trace_source[:JSON]` (JSON: TraceParams fields). Every KV layer selects,
    the MTP layer's (speculative) too."""
    return TraceTopk(model_cfg.kv_layers, model_cfg.topk, device, TraceParams(**kwargs))


def lru_miss_rate(
    select: Callable[[int], np.ndarray],
    seq_len0: int,
    capacity: int,
    window: int,
    steps: int,
    warmup: int,
) -> float:
    """Exact LRU of our plan (docs/ARCHITECTURE.md) over one (layer, request): per step, hits are
    selected positions in the window or the LRU set; m misses evict the m least recent
    non-hit entries; new order = untouched, hits (old order), misses (top-k order)."""
    order = np.full(capacity, -1, dtype=np.int64)
    selected = missed = 0
    for step in range(steps):
        seq_len = seq_len0 + step
        x = select(seq_len)
        valid = int((x >= 0).sum())  # the engine counts window hits as selected too
        order, misses = lru_update(order, x[(x >= 0) & (x < seq_len - window)])
        if step >= warmup:
            selected += valid
            missed += misses
    return missed / max(selected, 1)


def lru_update(order: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, int]:
    """One step of the plan's exact LRU over `order` (positions, least recent first; -1 free)
    with the distinct positions `x` past the window: (the new order, misses). m misses evict the
    m least recent non-hit entries; new order = untouched, hits (old order), misses (x's order)."""
    hit = np.isin(order, x)
    misses = x[~np.isin(x, order)]
    free = order[~hit]
    if len(misses) > len(free):
        raise ValueError(f"{len(misses)} misses, {len(free)} victims: the LRU is too small")
    return np.concatenate((free[len(misses) :], order[hit], misses)), len(misses)


def selector(params: TraceParams, k: int) -> Callable[[int], np.ndarray]:
    """The trace's selection of (layer 0, slot 0) at a sequence length, on CPU: int64 positions
    (-1: padding), for the LRU simulations here and in bench/shared/verify_misses.py."""
    gen = TraceTopk(1, k, "cpu", params)
    out = torch.empty((1, k), dtype=torch.int32)
    slots = torch.zeros(1, dtype=torch.int32)

    def select(seq_len: int) -> np.ndarray:
        gen(0, slots, torch.tensor([seq_len], dtype=torch.int32), out)
        return out[0].numpy().astype(np.int64)

    return select


def simulate(
    params: TraceParams,
    k: int = 2048,
    context: int = 32768,
    window: int = 128,
    capacities: tuple[int, ...] = (1, 2, 4),
    steps: int = 300,
    warmup: int = 50,
) -> dict[int, float]:
    """Miss rate of the trace for one (layer 0, slot 0) at LRU capacity c * k, steady state."""
    select = selector(params, k)
    return {
        c: lru_miss_rate(select, context, int(c * k), window, steps, warmup) for c in capacities
    }


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--calibrate", action="store_true", help="simulate the default parameters")
    ap.add_argument("--params", default="{}", help="TraceParams fields as JSON")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--topk", type=int, default=2048)
    args = ap.parse_args()
    params = TraceParams(**json.loads(args.params))
    rates = simulate(params, args.topk, args.context)
    print(
        json.dumps(
            {
                "params": asdict(params),
                "context": args.context,
                "miss_rate": {f"{c}k": round(r, 4) for c, r in rates.items()},
                "target": {f"{c}k": r for c, r in TARGET_MISS.items()},
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
