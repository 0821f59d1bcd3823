"""Cost of remote swap's check for repeated top-k positions (kv_service.memory.remote_swap
.mask_repeated_rows), next to the plan it guards.

    python bench/repeat_check.py

On CUDA: GPU time per call (CUDA graph replay) and host launch cost; on CPU: wall time.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.timing import cpu_call_us  # noqa: E402
from kv_service.memory.remote_swap import mask_repeated_rows  # noqa: E402


def rows(bs: int, k: int, context: int, device: torch.device) -> torch.Tensor:
    return torch.stack([torch.randperm(context, device=device)[:k] for _ in range(bs)]).int()


def gpu_us(call) -> float:
    from bench.timing import _events_ms, graph_time_us

    try:
        return graph_time_us(call, reps=50)
    except RuntimeError:  # not capturable: time it eagerly (includes launch gaps)
        return 1000.0 * _events_ms(call, 50)


def main() -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"device {device}; plan it guards: swap_plan bs 64, k 2048 = 10.28 us (H200, run 2)")
    print(
        f"{'bs':>4} {'k':>6} {'gpu us' if device.type == 'cuda' else 'wall us':>10} "
        f"{'launch us':>10}"
    )
    for bs, k in ((1, 2048), (16, 2048), (64, 2048), (64, 512)):
        topk = rows(bs, k, 32768, device)
        slots = torch.arange(bs, dtype=torch.int32, device=device)
        out = torch.empty_like(slots)
        call = lambda: mask_repeated_rows(topk, slots, out)  # noqa: E731
        if device.type == "cuda":
            print(f"{bs:>4} {k:>6} {gpu_us(call):>10.2f} {cpu_call_us(call):>10.2f}")
        else:
            call()
            t0 = time.perf_counter()
            for _ in range(20):
                call()
            print(f"{bs:>4} {k:>6} {(time.perf_counter() - t0) / 20 * 1e6:>10.1f} {'-':>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
