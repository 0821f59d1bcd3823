"""Service CPU cost of one step's bookkeeping: StepEnd for N requests through ServiceCore.

    python -m bench.bookkeeping [--requests 256] [--steps 200]

Runs on CPU (the bookkeeping is plain Python); the layout is sized for N requests.
"""

from __future__ import annotations

import argparse
import time

from contract.layout import KVLayout
from kv_service.core import ServiceCore
from kv_service.memory.store import allocate_local


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    n = args.requests
    lay = KVLayout(
        num_layers=1,
        max_requests=n,
        hot_slots=48,
        window=8,
        topk=32,
        page_size=16,
        num_pages=n * 8,
        max_context=128,
    )
    core = ServiceCore(allocate_local(lay), lease_seconds=30)
    sid = core.attach("bench").session_id
    ids = [f"r{i}" for i in range(n)]
    for rid in ids:
        core.admit(sid, rid, 16, 64)
    t0 = time.process_time()
    for step in range(args.steps):
        core.step_end(sid, [(rid, 17 + step % 64) for rid in ids], 100, 10, 1000)
    per = (time.process_time() - t0) / args.steps
    print(f"StepEnd bookkeeping for {n} requests: {per * 1e3:.3f} ms of service CPU per step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
