"""The decode step against the side-stream miss copy's grid (issue 38 item 2): which rule gives
the copy the fewest SMs that keep it in time, at each row format and locality.

    python -m bench.profile.copy_sweep --row-format fp8 --batch 222 --topk-source trace \\
        --out bench/results/copy-sweep-fp8-222-trace.json
    python -m bench.profile.copy_sweep --preset tiny --context 64 --batch 3 --grids none,2,8/2/1K
        # CPU

Builds the step once (bench.profile.breakdown's build: preset bench, embedded, 2 micro-batches,
32K synthetic contexts by default), then for each grid re-captures the step's graph and times it:
the copy's grid is fixed at capture, the rule inside it decides on the device. Grids (--grids,
comma-separated): `none` (no copy: timing only, wrong outputs), or a CopyGrid spec
(`CopyGrid.parse`, the engine's --decode-copy-grid): `default` (the backend's grid), `P` (P CTAs,
all working), `P/MIN/BYTES` (P launched, ceil(miss bytes / BYTES) working, at least MIN; BYTES
takes K/M suffixes), each optionally `@CHUNK` (the copy's bytes per CTA per iteration), then
`xW` (W warps per CTA: 16K x8 keeps the 4 vectors per thread of 8K x4) and `p` (the copy's
row-number prefetch), e.g. `24@8Kp`, `64/8/2M@16Kx8p`.
`--rounds` passes over the list, interleaved, so a drift shows as a spread; the table has each
grid's median step, its spread, and its copy cost: step minus the no-copy step. The JSON is
rewritten after every grid, so a run stopped by its time limit keeps what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch

from bench.profile.options import parse_args
from bench.profile.step import Stepper, build, misses_so_far, step_seconds
from engine_client.kv.hisparse import OVERLAP_COPY_GRID
from kernels.swap.copy_grid import CopyGrid

# The grids of the `copysweep` stage, besides the backend's own (OVERLAP_COPY_GRID).
DEFAULT_GRIDS = (
    "none,12,16,24,32,48,64,132,24@4K,16@16Kx8,12@16Kx8,16@8Kp,24@4Kp,"
    "64/8/512K,64/8/768K,64/16/1M,64/8/1536K,64/8/2M,64/8/3M,132/16/1M,64/8/2M@16Kx8,64/8/2M@8Kp"
)


@dataclasses.dataclass(frozen=True)
class Setting:
    """One grid of the sweep: its spec and the whole launch it names (None: no copy)."""

    spec: str
    grid: CopyGrid | None

    # The table's and JSON's columns: the launch's iteration (0 and False without a copy).
    @property
    def chunk(self) -> int:
        return self.grid.chunk_bytes if self.grid else 0

    @property
    def warps(self) -> int:
        return self.grid.warps if self.grid else 0

    @property
    def prefetch(self) -> bool:
        return self.grid.prefetch if self.grid else False


def setting(spec: str) -> Setting:
    """`none` (no copy), or a CopyGrid spec (kernels.swap.copy_grid.SPEC_GRAMMAR) whose
    `default` is the backend's grid."""
    if spec == "none":
        return Setting(spec, None)
    return Setting(spec, CopyGrid.parse(spec, default=OVERLAP_COPY_GRID))


class CopySwitch:
    """The kernel set's miss copy, switched on or off per setting before its graph is captured
    (the launch itself is the backend's copy_grid)."""

    def __init__(self, copy) -> None:
        self.copy, self.on = copy, True

    def set(self, s: Setting) -> None:
        self.on = s.grid is not None

    def __call__(self, *a, **kw) -> None:
        if self.on:
            self.copy(*a, **kw)


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, argparse.Namespace]:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--grids", default="default," + DEFAULT_GRIDS)
    ap.add_argument("--rounds", type=int, default=3, help="passes over the grids")
    ap.add_argument(
        "--budget-s", type=float, default=0, help="start no grid after this many seconds [none]"
    )
    ap.add_argument("--out", default="", help="JSON path [none]")
    own, rest = ap.parse_known_args(argv)
    defaults = ["--microbatches", "2", "--warmup", "2", "--steps", "5", "--no-families"]
    return own, parse_args(defaults + rest)


def measure(step: Stepper, args, backend, dev) -> dict:
    """Warm-up steps (the first captures), then the timed ones."""
    step(args.warmup)
    before = misses_so_far(backend)
    s = step_seconds(step, args.steps, dev)
    return {
        "step_ms": 1e3 * s,
        "miss_rows_per_step": (misses_so_far(backend) - before) / args.steps,
    }


def summarize(rows: list[dict], settings: list[Setting], per_launch: int, row_bytes: int):
    """Per grid: median step, spread over rounds, copy cost against `none`, working CTAs the
    rule picks for the mean launch (misses per step / launches per step)."""
    out = []
    for s in settings:
        mine = [r for r in rows if r["spec"] == s.spec]
        if not mine:
            continue
        steps = [r["step_ms"] for r in mine]
        launch_rows = statistics.median(r["miss_rows_per_step"] for r in mine) / per_launch
        out.append(
            {
                "spec": s.spec,
                "grid": "no copy" if s.grid is None else s.grid.label(),
                "chunk": s.chunk,
                "warps": s.warps,
                "prefetch": s.prefetch,
                "step_ms": statistics.median(steps),
                "spread_ms": max(steps) - min(steps),
                "miss_rows_per_launch": launch_rows,
                "working_ctas": None
                if s.grid is None or s.grid.programs is None
                else s.grid.active(round(launch_rows), row_bytes, s.grid.programs),
            }
        )
    base = [o["step_ms"] for o in out if o["grid"] == "no copy"]
    for o in out:
        o["copy_cost_ms"] = o["step_ms"] - base[0] if base else None
    return out


def print_table(title: str, summary: list[dict]) -> None:
    print(f"\n{title}")
    print(f"{'grid':<24} {'chunk':>8} {'step ms':>8} {'spread':>7} {'copy ms':>8} {'~CTAs':>6}")
    for o in summary:
        cost = "-" if o["copy_cost_ms"] is None else f"{o['copy_cost_ms']:.2f}"
        n = o["chunk"]
        chunk = (
            ("-" if not n else f"{n >> 10}K" if n >= 1024 else str(n))
            + (f"x{o['warps']}" if o["warps"] else "")
            + ("p" if o["prefetch"] else "")
        )
        print(
            f"{o['grid']:<24} {chunk:>8} {o['step_ms']:>8.2f} {o['spread_ms']:>7.2f} "
            f"{cost:>8} {o['working_ctas'] or '-':>6}"
        )


def main(argv: list[str] | None = None) -> int:
    t0 = time.perf_counter()
    own, args = parse(argv)
    settings = [setting(s) for s in own.grids.split(",") if s]
    dev = torch.device(
        args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    )
    positions = (args.warmup + args.steps) * len(settings) * own.rounds + 8
    cfg, lay, backend, runner = build(args, dev, positions)
    switch = CopySwitch(backend.kernels.miss_copy)
    backend.kernels = dataclasses.replace(backend.kernels, miss_copy=switch)
    step, rows = Stepper(runner, args.batch, args.context), []
    title = (
        f"copy sweep: {torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}, "
        f"{args.row_format} rows, N {args.batch}, context {args.context}, "
        f"{args.microbatches} micro-batches, top-k {args.topk_source}"
    )
    per_launch = cfg.num_layers * args.microbatches
    report = {"args": vars(args), "sweep": vars(own), "title": title, "rows": rows}
    for r in range(own.rounds):
        for s in settings:
            if own.budget_s and time.perf_counter() - t0 > own.budget_s:
                break
            switch.set(s)
            backend.set_copy_grid(s.grid or backend.copy_grid)
            runner.drop_graphs()  # the grid is fixed at capture
            rows.append({"spec": s.spec, "round": r, **measure(step, args, backend, dev)})
            print(f"round {r} {s.spec}: {rows[-1]['step_ms']:.2f} ms", flush=True)
            report["summary"] = summarize(rows, settings, per_launch, lay.row_bytes)
            if own.out:  # after every grid: a stage stopped by its limit keeps what it measured
                Path(own.out).parent.mkdir(parents=True, exist_ok=True)
                Path(own.out).write_text(json.dumps(report, indent=1))
    print_table(title, report["summary"])
    print(f"({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
