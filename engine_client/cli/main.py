"""`python -m engine_client {serve,generate,demo,gateway}`. Flags of `serve` default to ENGINE_*
env vars, those of `generate` to GENERATE_*, of `demo` to DEMO_* and of `gateway` to
GATEWAY_*."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence

from contract import flags
from contract.listen_address import AddressTaken
from engine_client.cli.config import DemoConfig, GenerateConfig
from engine_client.serve.config import EngineConfig


def add_serve(sub: argparse._SubParsersAction, env: Mapping[str, str]) -> None:
    p = sub.add_parser(
        "serve",
        help="run the decode engine server",
        description="Serve decode.v1.DecodeService (+ grpc health) on a Unix "
        "socket (and optionally TCP). Every flag defaults to the environment "
        "variable in its help. Resume: with --state-file, an engine restarted "
        "with the same file re-attaches to its KV session (within the service's "
        "lease) and continues its requests; a client gets the rest with "
        "`generate --resume REQUEST_ID` (tokens are replayed from index 0).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    flags.add_arguments(p, EngineConfig, "ENGINE", env)


def add_generate(sub: argparse._SubParsersAction, env: Mapping[str, str]) -> None:
    p = sub.add_parser(
        "generate",
        help="stream one generation from an engine",
        description="Stream one generation: tokens on stdout, then a summary. "
        "The first line on stderr is the request id ('request ID'), printed as "
        "soon as the engine has queued the request: after an engine restart "
        "(serve --state-file) `generate --resume ID` continues it. Every flag "
        "defaults to the environment variable in its help.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    flags.add_arguments(p, GenerateConfig, "GENERATE", env)


def add_demo(sub: argparse._SubParsersAction, env: Mapping[str, str]) -> None:
    p = sub.add_parser(
        "demo",
        help="start a KV service and an engine, stream a few generations",
        description="Start a KV service and an engine as subprocesses and stream "
        "a few concurrent generations. Every flag defaults to the environment "
        "variable in its help (DEMO_*; ENGINE_* variables do not apply).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    flags.add_arguments(p, DemoConfig, "DEMO", env)


def add_gateway(sub: argparse._SubParsersAction, env: Mapping[str, str]) -> None:
    from engine_client.gateway.config import GatewayConfig

    p = sub.add_parser(
        "gateway",
        help="serve the OpenAI-compatible HTTP API in front of an engine",
        description="Serve /v1/completions, /v1/chat/completions (stream=true: "
        "server-sent events) and /v1/models over HTTP, each request a Generate "
        "stream of the engine at --target. `serve --http ADDR` runs the same "
        "gateway inside the engine process. Every flag defaults to the "
        "environment variable in its help.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    flags.add_arguments(p, GatewayConfig, "GATEWAY", env)


def _gateway(args: argparse.Namespace, env: Mapping[str, str], parser) -> int:
    from engine_client.gateway.config import GatewayConfig
    from engine_client.gateway.server import run

    try:
        cfg = flags.build(GatewayConfig, args, "GATEWAY", env)
    except ValueError as e:
        parser.error(str(e))
    logging.basicConfig(
        level=cfg.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return run(cfg)
    except AddressTaken as e:
        logging.getLogger("engine_client").error("gateway cannot start: %s", e)
        return 1


def engine_config(args: argparse.Namespace, env: Mapping[str, str]) -> EngineConfig:
    return flags.build(EngineConfig, args, "ENGINE", env)


def _generate(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    from contract import errors
    from engine_client.cli.generate import run_generation

    try:
        cfg = flags.build(GenerateConfig, args, "GENERATE", env)
    except ValueError as e:
        print(f"generate: {e}", file=sys.stderr)
        return 2

    shown: list[int | str] = []

    def show(index: int, token: int) -> None:
        shown.append(token)
        if not cfg.text_output:
            print(token, end=" ", flush=True)

    def show_text(piece: str) -> None:
        shown.append(piece)
        print(piece, end="", flush=True)

    def announce(request_id: str) -> None:
        print(f"request {request_id}", file=sys.stderr, flush=True)

    try:
        result = asyncio.run(
            run_generation(
                cfg.target,
                cfg,
                show,
                announce,
                connect_timeout=cfg.connect_timeout,
                on_text=show_text if cfg.text_output else None,
            )
        )
    except errors.KVError as e:  # reachability's Unreachable and WrongPeer are KV errors too
        return _generation_failed(e, cfg.target, bool(shown))
    print()
    print(result.summary())
    return 0 if result.finish_reason in ("LENGTH", "STOP") else 1


def _generation_failed(e: Exception, target: str, after_tokens: bool) -> int:
    """Say why `generate` failed, on one line; the exit status (2: a usage error)."""
    import grpc

    from engine_client.client import reachability
    from engine_client.client.status import code_of

    if isinstance(e, (reachability.Unreachable, reachability.WrongPeer)):
        print(f"generate: {e}", file=sys.stderr)
        return 2 if isinstance(e, reachability.WrongPeer) else 1
    lead = "\n" if after_tokens else ""  # end the line of tokens first
    code = code_of(e)
    print(f"{lead}generate: error ({code.name}) from the engine at {target}: {e}", file=sys.stderr)
    # The engine refused what we asked (a flag's value): a usage error, like ours.
    return 2 if code is grpc.StatusCode.INVALID_ARGUMENT else 1


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    try:
        return _main(argv, env)
    except KeyboardInterrupt:
        return 130  # Ctrl-C: the user knows, no traceback


def _main(argv: Sequence[str] | None, env: Mapping[str, str] | None) -> int:
    env = os.environ if env is None else env
    parser = flags.OneLineParser(
        prog="python -m engine_client", description="HiSparse decode engine and its clients."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve(sub, env)
    add_generate(sub, env)
    add_demo(sub, env)
    add_gateway(sub, env)
    args = parser.parse_args(argv)
    if args.command == "gateway":
        return _gateway(args, env, parser)
    if args.command == "generate":
        return _generate(args, env)
    if args.command == "demo":
        return _demo(args, env, parser)
    return _serve(args, env, parser)


def _demo(args: argparse.Namespace, env: Mapping[str, str], parser: flags.OneLineParser) -> int:
    from engine_client.cli.demo import run_demo

    try:
        cfg = flags.build(DemoConfig, args, "DEMO", env)
    except ValueError as e:
        parser.error(str(e))
    return run_demo(cfg)


def _serve(args: argparse.Namespace, env: Mapping[str, str], parser: flags.OneLineParser) -> int:
    try:
        cfg = engine_config(args, env)
    except ValueError as e:
        parser.error(str(e))
    logging.basicConfig(
        level=cfg.observability.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from contract import errors

    # Both take the EngineConfig and return the exit status (their parameter names differ).
    run_engine: Callable[[EngineConfig], int]
    if cfg.endpoints.http is not None:
        from engine_client.cli.colocation import run_beside_engine as run_engine
    else:
        from engine_client.serve.server import run as run_engine
    try:
        return run_engine(cfg)
    except (errors.KVError, AddressTaken) as e:
        # Expected failures (service unreachable, layout mismatch, address taken, ...): the
        # message says it all.
        logging.getLogger("engine_client").error("engine failed: %s", e)
        return 1
    except Exception:
        logging.getLogger("engine_client").exception("engine failed")
        return 1
