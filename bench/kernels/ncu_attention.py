"""The engine's two-pass attention alone, for Nsight Compute (issue 38 item 4): attention is the
largest per-request term of every step profile (3.4-4.1 us a request-layer in situ against the
2.0 us asked), and nobody has yet looked inside its two kernels. One round of launches per row
format at one micro-batch of N 222 (bs 111: fp8 then bf16, the launch table's entry for that
batch), on bench.kernels.attention_sweep's inputs (random rows, random slot lists of k 2048 in
buffers of B 4096).

    ncu --clock-control none -k regex:"_score_kernel|_mix_kernel" --launch-skip 4 \\
        --launch-count 4 --section SpeedOfLight ... python3 -m bench.kernels.ncu_attention

(bench/gpu_session.sh's ncuattn stage.) The first 4 launches (score and mix per format)
compile and warm up; the next 4 are the ones to profile (with one format, two rounds each).
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from bench.kernels.attention_sweep import SCALE, H, K, inputs
from kernels.attention.configs import launch_config
from kernels.attention.sparse import TileWorkspace, sparse_mla_decode
from kernels.formats import ROW_FORMATS


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=111, help="requests in the launch")
    ap.add_argument("--formats", default="fp8,bf16", help="row formats, comma-separated")
    ap.add_argument(
        "--score-prefetch",
        action="store_true",
        help="the table's launch with the score pass's register prefetch (LaunchConfig)",
    )
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs CUDA (Nsight Compute profiles GPU kernels)")
    cases = []
    for fmt in args.formats.split(","):
        row_format = ROW_FORMATS[fmt]
        q, qp, kv, base, slots = inputs(args.batch, fmt)
        ws = TileWorkspace.allocate(args.batch, H, K, row_format=row_format, device="cuda")
        out = torch.empty((args.batch, H, 512), device="cuda", dtype=torch.bfloat16)
        lse = torch.empty((args.batch, H), device="cuda", dtype=torch.float32)
        cases.append((fmt, (q, qp, kv, base, slots, SCALE, out, lse), row_format, ws))

    def launch(row_format):
        cfg = launch_config(row_format, args.batch)
        return dataclasses.replace(cfg, score_prefetch=True) if args.score_prefetch else cfg

    # ncu skips the first 4 launches and profiles the next 4 (bench/gpu_session.sh): rounds of
    # 2 launches a format until both are spent (one format: 2 warm-up rounds, 2 profiled).
    for _ in range(2 * -(-4 // (2 * len(cases)))):
        for _, call, row_format, ws in cases:
            sparse_mla_decode(*call, row_format=row_format, workspace=ws, launch=launch(row_format))
        torch.cuda.synchronize()
    for fmt, _, row_format, _ in cases:
        print(f"{fmt}: bs {args.batch}, launch {launch(row_format)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
