"""`python -m engine_client {serve,generate,demo}`. Flags of `serve` default to ENGINE_* env vars."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Mapping, Sequence

from engine_client.config import (
    DEVICES,
    KERNELS,
    KV_MODES,
    DemoConfig,
    EngineConfig,
    GenerateConfig,
    LocalLayout,
    default_uds,
)

_BOOL = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


def _bool(text: str) -> bool:
    if text.lower() not in _BOOL:
        raise argparse.ArgumentTypeError(f"expected 1/0, true/false or yes/no, got {text!r}")
    return _BOOL[text.lower()]


def _optional(text: str) -> str | None:
    return text or None


def _optional_int(text: str) -> int | None:
    return int(text) if text else None


def _ids(text: str) -> tuple[int, ...]:
    return tuple(int(t) for t in text.replace(",", " ").split())


# (flag, type, default, help) of `serve`; the env variable is ENGINE_<FLAG>.
SERVE_FLAGS = [
    ("--kv-mode", str, "service", f"where KV lives: {', '.join(KV_MODES)}"),
    ("--uds", str, None, "Unix socket path the engine listens on"),
    ("--tcp", _optional, "", "also listen on HOST:PORT (insecure)"),
    ("--service", str, None, "KV service address (socket path, unix:PATH or HOST:PORT); "
     "service modes only"),
    ("--preset", str, "tiny", "model shapes: tiny, bench or v32"),
    ("--num-layers", _optional_int, "", "override the preset's layer count"),
    ("--checkpoint", _optional, "", "safetensors file or directory (DeepSeek-V3.2 names); "
     "empty: seeded random weights"),
    ("--weight-seed", int, "0", "seed of the random weights"),
    ("--device", str, "auto", f"{', '.join(DEVICES)}; service modes use the service's GPU"),
    ("--kernels", str, "auto", f"{', '.join(KERNELS)}: auto is Triton on CUDA and the torch "
     "references on CPU (Triton's interpreter is ~30x slower)"),
    ("--cuda-graphs", _bool, "1", "capture the decode step as CUDA graphs per batch bucket"),
    ("--cpu-threads", int, "1", "torch CPU threads; more than the free cores makes OpenMP spin "
     "against the KV service and slows CPU mode down by 10-30x"),
    ("--max-batch", int, "8", "most requests admitted and decoded together"),
    ("--prefill-chunk", int, "32", "prompt tokens per prefill chunk (one chunk per step)"),
    ("--max-requests", int, "8", "baseline/embedded: request slots of the local KV memory"),
    ("--hot-slots", int, "64", "embedded: hot rows per (layer, request)"),
    ("--window", int, "8", "embedded: newest tokens always resident"),
    ("--page-size", int, "16", "baseline/embedded: tokens per page"),
    ("--num-pages", int, "256", "embedded: pages of the host tier"),
    ("--max-context", int, "512", "baseline/embedded: most tokens per request"),
    ("--index-format", str, "bf16", "baseline/embedded: indexer key format, bf16 or fp8"),
    ("--row-format", _optional, "", "KV row format, bf16 (1152 B) or fp8 (656 B, DeepSeek-V3.2's "
     "FlashMLA rows); empty: the preset's (v32: fp8); service modes: must match the service"),
    ("--synthetic-context", int, "0", "benchmarks: prefix every prompt with this many synthetic "
     "context tokens, filled with random KV instead of a prefill"),
    ("--topk-source", str, "indexer", "benchmarks: decode top-k from the model's indexer, or "
     "from MODULE:FUNC[:JSON] (e.g. bench.trace:trace_source)"),
    ("--decode-microbatches", int, "1", "embedded/service: split each decode step into this "
     "many parts whose host->GPU miss copy overlaps the other parts' compute; 1 = off"),
    ("--state-file", _optional, "", "resume state (session id, prompts, tokens, seeds) so a "
     "restarted engine continues its requests; service modes; empty disables"),
    ("--engine-name", str, "engine", "name shown in the service's logs"),
    ("--rpc-timeout", float, "5", "deadline in seconds of every call to the KV service"),
    ("--attach-timeout", float, "5", "seconds to wait for the KV service at start (and for "
     "each attach); the compose files wait 60"),
    ("--heartbeat-interval", float, "1", "seconds between Session heartbeats"),
    ("--admit-retry", float, "0.5", "seconds between admission retries while the service "
     "has no capacity"),
    ("--overlap", _bool, "1", "launch decode step t + 1 before step t's tokens reach the host "
     "(0: wait for every step; debugging)"),
    ("--skip-ahead", float, "5", "seconds smaller requests may pass a queue head that waits "
     "for KV capacity"),
    ("--max-queue-wait", float, "300", "seconds a request may wait for admission before it "
     "fails with RESOURCE_EXHAUSTED; 0: no limit"),
    ("--metrics-port", _optional_int, "", "serve Prometheus /metrics on this port; empty: off"),
    ("--metrics-address", str, "127.0.0.1", "address of the /metrics endpoint"),
    ("--log-level", str.upper, "INFO", "logging level"),
]


def _env_name(flag: str) -> str:
    return "ENGINE_" + flag[2:].upper().replace("-", "_")


def add_serve(sub: argparse._SubParsersAction, env: Mapping[str, str]) -> None:
    p = sub.add_parser("serve", help="run the decode engine server",
                       description="Serve decode.v1.DecodeService (+ grpc health) on a Unix "
                       "socket (and optionally TCP). Every flag defaults to the environment "
                       "variable in its help. Resume: with --state-file, an engine restarted "
                       "with the same file re-attaches to its KV session (within the service's "
                       "lease) and continues its requests; a client gets the rest with "
                       "`generate --resume REQUEST_ID` (tokens are replayed from index 0).",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    defaults = {"--uds": default_uds(dict(env), "hisparse-engine.sock"),
                "--service": default_uds(dict(env), "hisparse-kv.sock")}
    for flag, typ, default, text in SERVE_FLAGS:
        value = env.get(_env_name(flag), defaults.get(flag, default))
        p.add_argument(flag, type=typ, default=value, help=f"{text} [env {_env_name(flag)}]")
    p.add_argument("--token", default=None, help="KV service token; prefer env ENGINE_TOKEN "
                   "(flags are visible in ps)")


def add_generate(sub: argparse._SubParsersAction, env: Mapping[str, str]) -> None:
    p = sub.add_parser("generate", help="stream one generation from an engine",
                       description="Stream one generation: tokens on stdout, then a summary. "
                       "The first line on stderr is the request id ('request ID'), printed as "
                       "soon as the engine has queued the request: after an engine restart "
                       "(serve --state-file) `generate --resume ID` continues it.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", default=env.get("ENGINE_TARGET", default_uds(dict(env), "hisparse-engine.sock")),
                   help="engine address: socket path, unix:PATH or HOST:PORT [env ENGINE_TARGET]")
    p.add_argument("--prompt", type=_ids, default=(1, 2, 3, 4), help="prompt token ids, e.g. '1,2,3'")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--stop", type=_ids, default=(), help="stop token ids")
    p.add_argument("--resume", default="", help="request id to resume after an engine restart")
    p.add_argument("--timeout", type=float, default=120.0, help="deadline of the whole stream (s)")
    p.add_argument("--connect-timeout", type=float, default=5.0,
                   help="seconds to wait for the engine to accept the connection")


def add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="start a KV service and an engine, stream a few generations",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--kv-mode", default="service", choices=KV_MODES)
    p.add_argument("--requests", type=int, default=4, help="concurrent generations")
    p.add_argument("--prompt-len", type=int, default=24)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--device", default="auto", choices=DEVICES)
    p.add_argument("--startup-timeout", type=float, default=60.0)
    p.add_argument("--no-progress", action="store_true", help="plain log lines, no live display")


def engine_config(args: argparse.Namespace, env: Mapping[str, str]) -> EngineConfig:
    local = LocalLayout(max_requests=args.max_requests, hot_slots=args.hot_slots,
                        window=args.window, page_size=args.page_size, num_pages=args.num_pages,
                        max_context=args.max_context, index_format=args.index_format)
    return EngineConfig(
        kv_mode=args.kv_mode, uds=args.uds, tcp=args.tcp, service=args.service,
        preset=args.preset, num_layers=args.num_layers, checkpoint=args.checkpoint,
        weight_seed=args.weight_seed, device=args.device, kernels=args.kernels,
        cuda_graphs=args.cuda_graphs, cpu_threads=args.cpu_threads, max_batch=args.max_batch, prefill_chunk=args.prefill_chunk,
        local=local, state_file=args.state_file, engine_name=args.engine_name,
        token=args.token or _optional(env.get("ENGINE_TOKEN", "")),
        rpc_timeout=args.rpc_timeout, attach_timeout=args.attach_timeout,
        heartbeat_interval=args.heartbeat_interval, admit_retry=args.admit_retry,
        synthetic_context=args.synthetic_context, topk_source=args.topk_source,
        overlap=args.overlap, skip_ahead=args.skip_ahead, max_queue_wait=args.max_queue_wait,
        metrics_port=args.metrics_port, metrics_address=args.metrics_address,
        row_format=args.row_format,
        decode_microbatches=args.decode_microbatches)


def _generate(args: argparse.Namespace) -> int:
    from engine_client.client import errors, reachability
    from engine_client.config import grpc_target
    from engine_client.decode_client import run_generation

    try:
        cfg = GenerateConfig(target=grpc_target(args.target), prompt=args.prompt,
                             max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                             seed=args.seed, stop_token_ids=args.stop,
                             resume_request_id=args.resume, timeout=args.timeout)
        if not args.connect_timeout > 0:
            raise ValueError(f"--connect-timeout must be > 0, got {args.connect_timeout}")
    except ValueError as e:
        print(f"generate: {e}", file=sys.stderr)
        return 2

    shown = []

    def show(index: int, token: int) -> None:
        shown.append(token)
        print(token, end=" ", flush=True)

    def announce(request_id: str) -> None:
        print(f"request {request_id}", file=sys.stderr, flush=True)

    try:
        result = asyncio.run(run_generation(cfg.target, cfg, show, announce,
                                            connect_timeout=args.connect_timeout))
    except reachability.Unreachable as e:
        print(f"generate: {e}", file=sys.stderr)
        return 1
    except errors.KVClientError as e:
        lead = "\n" if shown else ""  # end the line of tokens first
        print(f"{lead}generate: error ({errors.code_of(e).name}) from the engine at {cfg.target}: {e}",
              file=sys.stderr)
        return 1
    print()
    print(result.summary())
    return 0 if result.finish_reason in ("LENGTH", "STOP") else 1


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    try:
        return _main(argv, env)
    except KeyboardInterrupt:
        return 130  # Ctrl-C: the user knows, no traceback


def _main(argv: Sequence[str] | None, env: Mapping[str, str] | None) -> int:
    env = os.environ if env is None else env
    parser = argparse.ArgumentParser(prog="python -m engine_client",
                                     description="HiSparse decode engine and its clients.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve(sub, env)
    add_generate(sub, env)
    add_demo(sub)
    args = parser.parse_args(argv)
    if args.command == "generate":
        return _generate(args)
    if args.command == "demo":
        from engine_client.demo import run_demo
        try:
            cfg = DemoConfig(kv_mode=args.kv_mode, requests=args.requests,
                             prompt_len=args.prompt_len, max_new_tokens=args.max_new_tokens,
                             device=args.device, startup_timeout=args.startup_timeout,
                             progress=not args.no_progress)
        except ValueError as e:
            parser.error(str(e))
        return run_demo(cfg)
    try:
        cfg = engine_config(args, env)
    except ValueError as e:
        parser.error(str(e))
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from engine_client.client import errors
    from engine_client.server import run
    try:
        return run(cfg)
    except errors.KVClientError as e:
        # Expected failures (service unreachable, layout mismatch, ...): the message says it all.
        logging.getLogger("engine_client").error("engine failed: %s", e)
        return 1
    except Exception:
        logging.getLogger("engine_client").exception("engine failed")
        return 1


if __name__ == "__main__":
    sys.exit(main())
