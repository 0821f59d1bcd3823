"""`python -m kv_service`: start the KV service. Every flag has a KVS_* environment default;
both come from the fields of `ServiceConfig`."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping, Sequence

from contract import cuda_shm, flags
from kv_service.config import ServiceConfig


def build_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    p = flags.OneLineParser(
        prog="python -m kv_service",
        description="HiSparse KV service: owns one GPU's KV memory (host tier in /dev/shm, hot "
        "buffers, index-key pool) and serves kvcache.v1.KVCacheService over gRPC. "
        "Every flag defaults to the environment variable named in its help.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    flags.add_arguments(p, ServiceConfig, "KVS", env)
    return p


def parse_config(
    argv: Sequence[str] | None, env: Mapping[str, str]
) -> tuple[ServiceConfig, argparse.Namespace]:
    """The validated config; exits with a usage error (status 2) on bad flags or env values."""
    parser = build_parser(env)
    args = parser.parse_args(argv)
    try:
        return flags.build(ServiceConfig, args, "KVS", env), args
    except ValueError as exc:  # LayoutError included
        parser.error(str(exc))


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    config, _ = parse_config(argv, os.environ if env is None else env)
    logging.basicConfig(
        level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if config.device == "cpu":
        # CPU tensors need Triton's interpreter even on a machine with a GPU, where
        # kernels/__init__ would leave it off; it must be set before any kernel is defined.
        os.environ["TRITON_INTERPRET"] = "1"
    # Imported here so --help and flag errors do not pay for torch and grpc.
    from kv_service.rpc.server import ONE_LINE_ERRORS, run

    cuda_shm.remove_own_at_exit()  # the CUDA driver leaves its file of an IPC exporter

    try:
        return run(config)
    except ONE_LINE_ERRORS:
        return 1  # serve() logged the one line that says why
    except Exception as exc:
        # serve() logged the traceback where it happened.
        logging.getLogger("kv_service").error("service failed: %s: %s", type(exc).__name__, exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())
