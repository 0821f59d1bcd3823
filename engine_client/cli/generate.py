"""A streaming client of decode.v1.DecodeService.Generate (used by `generate` and `demo`).

`generate_stream` yields every token as it arrives and returns a `GenerationResult` with the
client-side timing (TTFT, inter-token latencies) and the engine's per-request stats. A resumed
stream replays tokens the client may already have: indexes below `skip_below` are dropped.
The engine names the request in the stream's initial metadata (REQUEST_ID_KEY), before any
token, so a client can resume it even if the engine stops during the prefill.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc

from contract import errors
from engine_client.cli.config import GenerateConfig
from engine_client.client import reachability
from engine_client.client.status import code_of, rpc_errors
from proto.decode.v1 import decode_pb2 as pb
from proto.decode.v1 import decode_pb2_grpc as pb_grpc

FINISH_NAMES = {v.number: v.name for v in pb.FinishReason.DESCRIPTOR.values}
REQUEST_ID_KEY = "request-id"
# How long `run_generation` waits for the engine to accept a connection.
CONNECT_TIMEOUT = 5.0


@dataclass
class GenerationResult:
    request_id: str = ""
    tokens: list[int] = field(default_factory=list)
    arrival_s: list[float] = field(default_factory=list)
    ttft_s: float | None = None
    finish_reason: str = ""
    error: str = ""
    hits: int = 0
    misses: int = 0
    bytes_moved: int = 0
    text: str = ""  # text output, concatenated
    prompt_tokens: int = 0
    cached_tokens: int = 0
    queued_s: float = 0.0  # the engine's queue wait (FinalStats.queued_us)
    prefill_wait_s: float = 0.0  # admission to its first prefill chunk (prefill_wait_us)

    @property
    def itl_s(self) -> list[float]:
        return [b - a for a, b in zip(self.arrival_s, self.arrival_s[1:])]

    @property
    def hit_rate(self) -> float | None:
        total = self.hits + self.misses
        return self.hits / total if total else None

    def summary(self) -> str:
        itl = self.itl_s
        parts = [f"request {self.request_id}: {len(self.tokens)} tokens, {self.finish_reason}"]
        if self.ttft_s is not None:
            parts.append(f"TTFT {self.ttft_s * 1e3:.1f} ms")
        if itl:
            parts.append(
                f"ITL mean {statistics.fmean(itl) * 1e3:.1f} ms, "
                f"p50 {statistics.median(itl) * 1e3:.1f} ms, max {max(itl) * 1e3:.1f} ms"
            )
        rate = self.hit_rate
        parts.append(f"hit rate {rate:.1%}" if rate is not None else "hit rate n/a")
        parts.append(f"{self.bytes_moved} B moved")
        parts.append(f"{self.cached_tokens} prompt tokens cached")
        if self.error:
            parts.append(f"error: {self.error}")
        return ", ".join(parts)


def build_request(cfg: GenerateConfig, text: bool = False) -> pb.GenerateRequest:
    """text: text output for a token-id prompt too (text and chat prompts always have it);
    generate_stream asks for it when it has an `on_text` to give it to."""
    req = pb.GenerateRequest(
        max_new_tokens=cfg.max_new_tokens,
        return_text=text,
        sampling=pb.Sampling(
            temperature=cfg.temperature, seed=cfg.seed, stop_token_ids=list(cfg.stop_token_ids)
        ),
        resume_request_id=cfg.resume_request_id,
        cache_salt=cfg.cache_salt,
    )
    if cfg.chat:
        req.chat.messages.add(role="user", content=cfg.chat)
    elif cfg.text:
        req.text = cfg.text
    elif cfg.prompt:
        req.token_ids.ids.extend(cfg.prompt)
    return req


async def generate_stream(
    channel: grpc.aio.Channel,
    cfg: GenerateConfig,
    result: GenerationResult,
    skip_below: int = 0,
    on_request_id: Callable[[str], None] | None = None,
    on_text: Callable[[str], None] | None = None,
) -> AsyncIterator[tuple[int, int]]:
    """Yield (index, token) as they arrive; fill `result`. Raises a typed client error
    (ServiceUnavailable, UnknownRequest, InvalidArgument, ...) if the stream fails.
    `on_request_id` is called with the request id as soon as the engine has queued it,
    `on_text` with each piece of text output (before its token is yielded)."""
    stub = pb_grpc.DecodeServiceStub(channel)
    started = time.monotonic()
    request = build_request(cfg, text=on_text is not None)
    call = stub.Generate(request, timeout=cfg.timeout, wait_for_ready=True)
    try:
        with rpc_errors(f"Generate {cfg.resume_request_id}".strip()):
            metadata = dict(await call.initial_metadata() or ())
            if metadata.get(REQUEST_ID_KEY):
                result.request_id = metadata[REQUEST_ID_KEY]
                if on_request_id is not None:
                    on_request_id(result.request_id)
            async for resp in call:
                result.request_id = resp.request_id
                if resp.text and (resp.index >= skip_below or not resp.has_token):
                    result.text += resp.text
                    if on_text is not None:
                        on_text(resp.text)
                if resp.has_token and resp.index >= skip_below:
                    now = time.monotonic()
                    if result.ttft_s is None:
                        result.ttft_s = now - started
                    result.tokens.append(resp.token_id)
                    result.arrival_s.append(now)
                    yield resp.index, resp.token_id
                if resp.finished:
                    _record_end(result, resp)
    finally:
        call.cancel()


def _record_end(result: GenerationResult, resp: pb.GenerateResponse) -> None:
    """The last response's finish reason, error, swap counters and token usage."""
    result.finish_reason = FINISH_NAMES.get(resp.finish_reason, "UNKNOWN")
    result.error = resp.error_message
    result.hits, result.misses = resp.stats.hits, resp.stats.misses
    result.bytes_moved = resp.stats.bytes_moved
    result.queued_s = resp.stats.queued_us / 1e6
    result.prefill_wait_s = resp.stats.prefill_wait_us / 1e6
    result.prompt_tokens = resp.usage.prompt_tokens
    result.cached_tokens = resp.usage.cached_tokens


async def run_generation(
    target: str,
    cfg: GenerateConfig,
    on_token: Callable[[int, int], None] | None = None,
    on_request_id: Callable[[str], None] | None = None,
    connect_timeout: float = CONNECT_TIMEOUT,
    on_text: Callable[[str], None] | None = None,
) -> GenerationResult:
    """One whole generation on its own channel. An engine that does not accept the connection
    within `connect_timeout` is `reachability.Unreachable`, naming the address."""
    result = GenerationResult(request_id=cfg.resume_request_id)
    async with grpc.aio.insecure_channel(target) as channel:
        await reachability.wait_ready(channel, reachability.ENGINE, target, connect_timeout)
        try:
            async for index, token in generate_stream(
                channel, cfg, result, on_request_id=on_request_id, on_text=on_text
            ):
                if on_token is not None:
                    on_token(index, token)
        except errors.KVError as e:
            if code_of(e) is not grpc.StatusCode.UNIMPLEMENTED:
                raise
            raise (await reachability.wrong_peer(channel, reachability.ENGINE, target)) or e
    return result
