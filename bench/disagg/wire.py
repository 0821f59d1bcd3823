"""NIXL's wire between two processes on this machine, without the engines (issue 42): one
process registers a pinned host buffer as the decode side's host tier does, the other writes
`--size` bytes into it from host memory (DRAM: pageable, or `pinned` by CUDA) or device memory
(VRAM) cut into `--pieces` equal descriptors, and reports GB/s per repeat. A prompt is
thousands of small descriptors when written a span per layer and page (46 MB as 4,096 spans
in run Z), far fewer when the source is page-major like the target
(`contract.transfer_target.merged`): this measures what the descriptor count costs on each
source, against the pinned device-to-host copy.

    python -m bench.disagg.wire                              # DRAM, 44 MiB in 1, 128, 4096
    python -m bench.disagg.wire --source vram --pieces 1,128,4096 --repeats 5
    python -m bench.disagg.wire --error-handling none        # NIXL UCX's ucx_error_handling_mode
    python -m bench.disagg.wire --source pinned --target vram --pieces 1,512   # the index keys'
        # path of a staged write: host memory into the decode side's device memory, 8 KB spans

Needs the nixl package (`bash bench/device_wheels.sh nixl` on the GPU machine). JSON to
bench/results/disagg-wire-<date>.json unless --out.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from pathlib import Path

from bench.shared.result_file import write_json


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size", type=int, default=44 << 20, help="bytes per write")
    ap.add_argument("--pieces", default="1,128,4096", help="descriptor counts, comma-separated")
    ap.add_argument(
        "--source",
        choices=("dram", "pinned", "pinned-late", "vram"),
        default="dram",
        help="host memory (pinned: page-locked by CUDA, as the staged source's buffer; "
        "pinned-late: allocated after the agent, as the engine's stage is) or device",
    )
    ap.add_argument(
        "--target",
        choices=("dram", "vram"),
        default="dram",
        help="the decode side's memory: its host tier (pinned host) or, as its index-key pool, "
        "device memory",
    )
    ap.add_argument("--repeats", type=int, default=4, help="writes per count (the first warms)")
    ap.add_argument(
        "--error-handling", default="", help="UCX backend's ucx_error_handling_mode (peer, none)"
    )
    ap.add_argument("--out", default="", help="JSON path [bench/results/disagg-wire-<date>.json]")
    args = ap.parse_args(argv)
    args.pieces = [int(p) for p in args.pieces.split(",")]
    if args.size < 1 or any(p < 1 or args.size % p for p in args.pieces):
        ap.error(f"--size {args.size} must split evenly into each of --pieces {args.pieces}")
    return args


def _agent(name: str, mode: str):
    from contract.nixl_agent import BACKEND, load_nixl

    api = load_nixl()
    agent = api.nixl_agent(name, api.nixl_agent_config(backends=[]))
    agent.create_backend(BACKEND, {"ucx_error_handling_mode": mode} if mode else {})
    return agent


def _target(conn, size: int, mode: str, kind: str) -> None:
    """The decode side: a pinned host buffer (pinned where CUDA is) registered as DRAM, or
    (kind vram) device memory registered as VRAM, as the index-key pool is."""
    import torch

    if kind == "vram":
        host = torch.zeros(size, dtype=torch.uint8, device="cuda")
    else:
        host = torch.zeros(size, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    agent = _agent("wire-target", mode)
    agent.register_memory([(host.data_ptr(), size, 0, "")], kind.upper())
    conn.send((agent.get_agent_metadata(), host.data_ptr()))
    conn.recv()  # every write done
    conn.send(int(host[:: max(1, size // 4096)].sum()))


def _writer(conn, args: argparse.Namespace) -> None:
    import numpy as np
    import torch

    device = "cuda" if args.source == "vram" else "cpu"
    pin, late = args.source.startswith("pinned"), args.source.endswith("late")
    if late:  # UCX loaded first: its memory hooks see the pinned allocation
        agent = _agent("wire-writer", args.error_handling)
    src = torch.full((args.size,), 3, dtype=torch.uint8, device=device, pin_memory=pin)
    kind, dev = ("VRAM", 0) if device == "cuda" else ("DRAM", 0)
    if not late:
        agent = _agent("wire-writer", args.error_handling)
    agent.register_memory([(src.data_ptr(), args.size, dev, "")], kind)
    meta, remote = conn.recv()
    peer = agent.add_remote_agent(meta)
    peer = peer if isinstance(peer, str) else peer.decode()
    rows = []
    for pieces in args.pieces:
        step = args.size // pieces
        local = np.array([(src.data_ptr() + i * step, step, dev) for i in range(pieces)])
        far = np.array([(remote + i * step, step, 0) for i in range(pieces)])
        for rep in range(args.repeats):
            handle = agent.initialize_xfer(
                "WRITE",
                agent.get_xfer_descs(local.astype(np.uint64), kind),
                agent.get_xfer_descs(far.astype(np.uint64), args.target.upper()),
                peer,
            )
            start = time.perf_counter()
            state = agent.transfer(handle)
            while state not in ("DONE", "ERR"):
                state = agent.check_xfer_state(handle)
            seconds = time.perf_counter() - start
            agent.release_xfer_handle(handle)
            rows.append({"pieces": pieces, "repeat": rep, "state": state, "seconds": seconds})
    conn.send(rows)


def measure(args: argparse.Namespace) -> list[dict]:
    """Every write's seconds, the target checked to hold the writer's bytes."""
    ctx = mp.get_context("spawn")  # no CUDA context inherited; the agents are per process
    t_end, t_far = ctx.Pipe()
    w_end, w_far = ctx.Pipe()
    target = ctx.Process(target=_target, args=(t_far, args.size, args.error_handling, args.target))
    target.start()
    writer = ctx.Process(target=_writer, args=(w_far, args))
    writer.start()
    try:
        w_end.send(t_end.recv())
        rows = w_end.recv()
        t_end.send("done")
        landed = t_end.recv()
    finally:
        for p in (writer, target):
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    expect = 3 * len(range(0, args.size, max(1, args.size // 4096)))
    if landed != expect:
        raise RuntimeError(f"the target holds {landed}, expected {expect}: the writes lost bytes")
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = measure(args)
    print(f"{'pieces':>7} {'bytes each':>11} {'GB/s (repeats after the first)':>32}")
    for pieces in args.pieces:
        runs = [r for r in rows if r["pieces"] == pieces and r["repeat"] > 0] or [
            r for r in rows if r["pieces"] == pieces
        ]
        rates = " ".join(f"{args.size / r['seconds'] / 1e9:6.2f}" for r in runs)
        print(f"{pieces:7d} {args.size // pieces:11d}   {rates}")
    date = time.strftime("%Y-%m-%d %H:%M:%S")
    result = {"date": date, "args": {k: v for k, v in vars(args).items() if k != "out"}}
    out = Path(args.out or f"bench/results/disagg-wire-{date[:10]}.json")
    write_json({**result, "writes": rows}, out)
    print(f"-> {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
