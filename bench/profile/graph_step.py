"""Decode steps per second with and without CUDA graphs, and the CPU time per step.

    python -m bench.profile.graph_step [--batch 32] [--context 8192] [--steps 30] [--layers 4]

Needs CUDA. Embedded HiSparse backend (in-stream swap) on the `bench` preset's attention shapes;
each request starts from a synthetic context. Both runs replay the same steps.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from bench.profile.step import offloaded_backend
from contract.layout import KVLayout
from engine_client.model.model import Model
from engine_client.model.model_runner import DecodeConfig, ModelRunner
from engine_client.model.preset import preset
from engine_client.model.weights import random_weights
from kernels.kit.kernel_set import KernelSet


def run(args: argparse.Namespace, use_graphs: bool, weights, cfg) -> dict:
    backend = offloaded_backend(_layout(args, cfg), args.batch, "cuda", kernels=KernelSet.triton())
    model = Model(cfg, weights, backend)
    for slot in range(args.batch):
        backend.fill_synthetic(slot, args.context, seed=slot)
    runner = ModelRunner(model, DecodeConfig(max_batch=args.batch, use_graphs=use_graphs))
    slots = list(range(args.batch))
    tokens = [1] * args.batch

    def step(i: int) -> None:
        pos = [args.context + i] * args.batch
        runner.step(tokens, pos, slots, [p + 1 for p in pos])  # noqa: F821

    for i in range(3):
        step(i)
    torch.cuda.synchronize()
    wall0, cpu0 = time.perf_counter(), time.process_time()
    for i in range(3, 3 + args.steps):
        step(i)
    torch.cuda.synchronize()
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    # Free memory now; pyflakes reads the lambdas' names as undefined after this (F821).
    del runner, model, backend
    torch.cuda.empty_cache()
    return {
        "graphs": use_graphs,
        "steps_per_s": args.steps / wall,
        "ms_per_step": 1e3 * wall / args.steps,
        "cpu_ms_per_step": 1e3 * cpu / args.steps,
    }


def _layout(args: argparse.Namespace, cfg) -> KVLayout:
    return KVLayout(
        num_layers=cfg.num_layers,
        max_requests=args.batch,
        hot_slots=4096,
        window=128,
        topk=cfg.topk,
        page_size=64,
        num_pages=args.batch * (args.context // 64 + 4),
        max_context=args.context + 256,
        index_format="fp8",
    )


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--out", default="bench/results/graph_step.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/profile/graph_step.py needs CUDA", file=sys.stderr)
        return 2
    cfg = preset("bench", num_layers=args.layers)
    weights = random_weights(cfg, seed=0, device="cuda")
    rows = [run(args, False, weights, cfg), run(args, True, weights, cfg)]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    print(
        f"\ndecode step, bench preset {args.layers} layers, batch {args.batch}, "
        f"context {args.context}"
    )
    for r in rows:
        print(
            f"  graphs={r['graphs']!s:<5} {r['steps_per_s']:8.1f} steps/s  "
            f"{r['ms_per_step']:7.2f} ms/step"
            f"  CPU {r['cpu_ms_per_step']:7.2f} ms/step"
        )
    print(f"  graphs speed-up {rows[1]['steps_per_s'] / rows[0]['steps_per_s']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
