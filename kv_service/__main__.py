"""`python -m kv_service`: start the KV service. Every flag has a KVS_* environment default."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping, Sequence

from contract.layout import KVLayout
from kv_service.config import ServiceConfig, default_uds_path

# (flag, env suffix, type, default, help). Layout defaults are DeepSeek-V3.2-shaped.
LAYOUT_FLAGS = [
    ("--num-layers", "NUM_LAYERS", int, "61", "L: layers whose KV the service holds"),
    ("--max-requests", "MAX_REQUESTS", int, "64", "R: request slots (concurrent requests)"),
    ("--hot-slots", "HOT_SLOTS", int, "4096", "B: hot rows per (layer, request) on the device"),
    ("--window", "WINDOW", int, "128", "W: newest tokens always resident (ring in slots [0, W))"),
    ("--topk", "TOPK", int, "2048", "k: tokens selected per (layer, request, step)"),
    ("--page-size", "PAGE_SIZE", int, "64", "P: tokens per page of the host tier / index pool"),
    ("--num-pages", "NUM_PAGES", int, "2048", "pages in the host tier (and the index-key pool); "
     "the host tier takes num_pages * L * P * row bytes of /dev/shm"),
    ("--max-context", "MAX_CONTEXT", int, "131072", "most tokens per request (prompt + generated)"),
    ("--row-format", "ROW_FORMAT", str, "bf16", "KV row format: bf16 (1152 B) or fp8 (656 B)"),
    ("--index-format", "INDEX_FORMAT", str, "bf16", "indexer key format: bf16 (256 B) or fp8 (132 B)"),
]


def _octal(text: str) -> int:
    return int(text, 8)


def _optional(text: str) -> str | None:
    return text or None


def _optional_port(text: str) -> int | None:
    return int(text) if text else None


def build_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kv_service",
        description="HiSparse KV service: owns one GPU's KV memory (host tier in /dev/shm, hot "
                    "buffers, index-key pool) and serves kvcache.v1.KVCacheService over gRPC. "
                    "Every flag defaults to the environment variable named in its help.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)

    def add(flag: str, suffix: str, typ: object, default: str, help_text: str) -> None:
        p.add_argument(flag, type=typ, default=env.get(f"KVS_{suffix}", default),
                       help=f"{help_text} [env KVS_{suffix}]")

    add("--uds", "UDS", str, default_uds_path(dict(env)), "Unix socket path to listen on")
    add("--tcp", "TCP", _optional, "", "also listen on HOST:PORT (insecure; use with a token)")
    add("--device", "DEVICE", str, "auto", "auto, cpu or cuda (pick the GPU with CUDA_VISIBLE_DEVICES)")
    # The token's env value must not show up in --help, so it is resolved after parsing.
    p.add_argument("--token", type=_optional, default=None,
                   help="shared secret; clients send 'authorization: Bearer <token>'. Prefer "
                        "the env variable KVS_TOKEN: flags are visible in ps")
    add("--lease-seconds", "LEASE_SECONDS", float, "30", "how long a session's requests survive "
        "without an open Session stream (engine restart window)")
    add("--drain-timeout", "DRAIN_TIMEOUT", float, "30", "on SIGTERM, seconds to wait for "
        "admitted requests to be released before stopping")
    add("--metrics-port", "METRICS_PORT", _optional_port, "", "serve Prometheus /metrics on this "
        "port; empty disables")
    add("--metrics-address", "METRICS_ADDRESS", str, "127.0.0.1", "address the metrics port "
        "binds: 127.0.0.1 keeps it on this host; 0.0.0.0 or :: exposes it (it has no auth)")
    add("--shm-dir", "SHM_DIR", str, "/dev/shm", "directory of the shared-memory segment files")
    add("--instance", "INSTANCE", str, "hisparse-kv", "instance name, part of segment file names")
    add("--socket-mode", "SOCKET_MODE", _octal, "600", "socket file mode, 600 or 660 (octal)")
    add("--max-message-bytes", "MAX_MESSAGE_BYTES", int, str(4 * 1024 * 1024),
        "largest gRPC message accepted or sent")
    add("--warmup", "WARMUP", lambda s: s.lower() not in ("0", "false", "no"), "1",
        "on CUDA, compile and run the swap kernels once before reporting SERVING (0 disables)")
    add("--log-level", "LOG_LEVEL", str.upper, "INFO", "logging level")
    for flag, suffix, typ, default, help_text in LAYOUT_FLAGS:
        add(flag, suffix, typ, default, help_text)
    return p


def config_from_args(args: argparse.Namespace) -> ServiceConfig:
    layout = KVLayout(**{flag[2:].replace("-", "_"): getattr(args, flag[2:].replace("-", "_"))
                         for flag, *_ in LAYOUT_FLAGS})
    return ServiceConfig(
        layout=layout, uds=args.uds, tcp=args.tcp, device=args.device, token=args.token,
        lease_seconds=args.lease_seconds, drain_timeout=args.drain_timeout,
        metrics_port=args.metrics_port, metrics_address=args.metrics_address, shm_dir=args.shm_dir, instance=args.instance,
        socket_mode=args.socket_mode, max_message_bytes=args.max_message_bytes,
        warmup=args.warmup)


def parse(argv: Sequence[str] | None, env: Mapping[str, str]) -> tuple[ServiceConfig, argparse.Namespace]:
    """The validated config; exits with a usage error (status 2) on bad flags or env values."""
    parser = build_parser(env)
    args = parser.parse_args(argv)
    if args.token is None:
        args.token = _optional(env.get("KVS_TOKEN", ""))
    try:
        return config_from_args(args), args
    except ValueError as exc:  # LayoutError included
        parser.error(str(exc))


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    config, args = parse(argv, os.environ if env is None else env)
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if config.device == "cpu":
        # CPU tensors need Triton's interpreter even on a machine with a GPU, where
        # kernels/__init__ would leave it off; it must be set before any kernel is defined.
        os.environ["TRITON_INTERPRET"] = "1"
    # Imported here so --help and flag errors do not pay for torch and grpc.
    from kv_service.server import run

    try:
        return run(config)
    except Exception as exc:
        # serve() logged the traceback where it happened.
        logging.getLogger("kv_service").error("service failed: %s: %s", type(exc).__name__, exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())
