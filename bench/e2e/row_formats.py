"""Per-row-format summary of bench.e2e runs (bf16 1152 B rows vs DeepSeek-V3.2's fp8 656 B
rows; the baseline always runs the same format as HiSparse).

    python -m bench.e2e.row_formats E2E_BF16.json E2E_FP8.json     # summary of finished runs

Per format and context: max requests (baseline, HiSparse), decode tok/s at each mode's max
(trace top-k), the service's miss traffic (GB/s) and the attention kernel's GPU time per
request-layer at HiSparse's max batch, with the engine's own kernel settings (measured by
`probe_attention` in a child process, so the benchmark process never holds a CUDA context).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.shared.child import run_python

H, K, B = 128, 2048, 4096

_PROBE = """
import json, sys, torch
from bench.shared.timing import graph_time_us
from kernels.formats import ROW_FORMATS
from kernels.store.fp8_row import kv_quantize
from kernels.attention.sparse import TileWorkspace, sparse_mla_decode
fmt, H, K, B = ROW_FORMATS[sys.argv[1]], *map(int, sys.argv[2:5])
out = {}
for bs in map(int, sys.argv[5].split(",")):
    rows = torch.randn((bs * B, 576), device="cuda", dtype=torch.bfloat16)
    if fmt.quantize is not None:
        kv = torch.empty((bs * B, fmt.row_bytes), device="cuda", dtype=torch.uint8)
        kv_quantize(rows, kv, row_format=fmt)
    else:
        kv = rows
    q = torch.randn((bs, H, 512), device="cuda", dtype=torch.bfloat16)
    qp = torch.randn((bs, H, 64), device="cuda", dtype=torch.bfloat16)
    base = torch.arange(bs, device="cuda", dtype=torch.int64) * B
    slots = torch.argsort(torch.rand(bs, B, device="cuda"), 1)[:, :K].to(torch.int32)
    o = torch.empty((bs, H, 512), device="cuda", dtype=torch.bfloat16)
    lse = torch.empty((bs, H), device="cuda", dtype=torch.float32)
    # The engine's decode workspace (engine_client.model.model.Workspace).
    ws = TileWorkspace.allocate(bs, H, K, row_format=fmt, device="cuda")
    us = graph_time_us(lambda: sparse_mla_decode(q, qp, kv, base, slots, 576 ** -0.5, o, lse,
                                                 row_format=fmt, workspace=ws), 20, inner=5)
    out[bs] = us / bs
    del rows, kv
print(json.dumps(out))
"""


def probe_attention(row_format: str, batches: list[int]) -> dict[int, float] | None:
    """Attention GPU µs per request-layer (bs H128 k2048 B4096) for each batch size."""
    args = [row_format, str(H), str(K), str(B), ",".join(map(str, batches))]
    proc = run_python(_PROBE, args, timeout=600)
    if proc.returncode != 0:
        print(f"attention probe ({row_format}) failed: {proc.stderr[-500:]}", file=sys.stderr)
        return None
    return {int(k): v for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}


def _phase(payload: dict, ctx: int, mode: str, key: str):
    for r in payload["runs"]:
        if (r["context"], r["mode"], r["source"], r["tag"]) == (ctx, mode, "trace", "main"):
            return r["phases"].get("max", {}).get(key)
    return None


def summary(payload: dict) -> list[dict]:
    """One line per context of one format's e2e payload."""
    fmt = payload["sizes"]["row_format"]
    probe = payload.get("attention_probe") or {}
    lines = []
    for ctx, p in payload["plans"].items():
        n_hs = p["hisparse"]["max_requests"]
        lines.append(
            {
                "row_format": fmt,
                "context": int(ctx),
                "max_req_baseline": p["baseline"]["max_requests"],
                "max_req_hisparse": n_hs,
                "tok_s_baseline": _phase(payload, int(ctx), "baseline", "tok_s"),
                "tok_s_service": _phase(payload, int(ctx), "service", "tok_s"),
                "miss_gbs_service": _phase(payload, int(ctx), "service", "h2d_gbs"),
                "attn_us_per_req_layer": probe.get(str(n_hs), probe.get(n_hs)),
            }
        )
    return lines


def _f(v, fmt: str = "{:.1f}") -> str:
    return "-" if v is None else fmt.format(v)


def print_summary(payloads: list[dict]) -> None:
    print("\nrow formats (baseline in the same format as HiSparse; trace top-k, max phase)")
    head = (
        f"{'format':<6} {'context':>8} {'maxN base':>9} {'maxN HS':>8} {'tok/s base':>10} "
        f"{'tok/s svc':>10} {'svc/base':>8} {'miss GB/s':>9} {'attn us/req-layer':>17}"
    )
    print(head + "\n" + "-" * len(head))
    for payload in payloads:
        for s in summary(payload):
            ratio = (
                s["tok_s_service"] / s["tok_s_baseline"]
                if s["tok_s_service"] and s["tok_s_baseline"]
                else None
            )
            print(
                f"{s['row_format']:<6} {s['context']:>8} {s['max_req_baseline']:>9} "
                f"{s['max_req_hisparse']:>8} {_f(s['tok_s_baseline']):>10} "
                f"{_f(s['tok_s_service']):>10} {_f(ratio, '{:.2f}x'):>8} "
                f"{_f(s['miss_gbs_service'], '{:.2f}'):>9} "
                f"{_f(s['attn_us_per_req_layer'], '{:.2f}'):>17}"
            )


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    print_summary([json.loads(Path(p).read_text()) for p in argv])
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
