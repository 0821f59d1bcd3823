"""decode.v1.DecodeService's Generate: a request checked (ids, lengths, sampling, ids of a
resume) and submitted to the engine, its tokens streamed back, and how a request that ends in an
error closes its stream (`FAIL_CODES`). The process around it is `engine_client.serve.server`."""

from __future__ import annotations

import asyncio
import logging
import math

import grpc

from contract import errors
from contract.ids import id_problem
from contract.prefix import MAX_SALT_BYTES
from engine_client.loop.engine import Engine
from engine_client.loop.request import FailStatus, Finish, GenRequest, SamplingParams
from engine_client.loop.synthetic import prompt_serial
from engine_client.serve import prompt
from proto.decode.v1 import decode_pb2 as pb
from proto.decode.v1 import decode_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

# The status a stream that ended with an ERROR finish closes with.
FAIL_CODES = {
    FailStatus.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    FailStatus.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    FailStatus.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    FailStatus.INTERNAL: grpc.StatusCode.INTERNAL,
}


# Where the per-request token limit is set, by who holds the KV.
CONTEXT_FLAGS = {
    True: "the KV service's --max-context (KVS_MAX_CONTEXT)",
    False: "the engine's --max-context (ENGINE_MAX_CONTEXT)",
}


class DecodeServicer(pb_grpc.DecodeServiceServicer):
    def __init__(self, uses_service: bool = True) -> None:
        self.engine: Engine | None = None
        self.context_flag = CONTEXT_FLAGS[uses_service]

    def _check(self, request: pb.GenerateRequest, ids: list[int]) -> str | None:
        """Why the request is invalid, or None."""
        engine = self.engine
        assert engine is not None  # _open turns requests away until the engine is set
        vocab = engine.compute.model.cfg.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            return f"token ids must be in [0, {vocab})"
        if request.max_new_tokens < 1:
            return "max_new_tokens must be >= 1"
        room, synthetic = engine.compute.layout.max_context, engine.compute.synthetic_context
        spec = engine.scheduler.reserve_extra  # speculative steps' rows past the last token
        need = synthetic + len(ids) + request.max_new_tokens + spec
        if need > room:
            extra = f" + {synthetic} synthetic context" if synthetic else ""
            extra += f" + {spec} speculative rows" if spec else ""
            return (
                f"prompt {len(ids)} + max_new_tokens {request.max_new_tokens}{extra} = {need} "
                f"tokens, over the {room} a request may hold ({self.context_flag}): ask for at "
                f"most {max(room - need + request.max_new_tokens, 0)} new tokens, or raise it"
            )
        s = request.sampling
        if not math.isfinite(s.temperature) or s.temperature < 0:
            return "temperature must be finite and >= 0"
        if len(request.cache_salt.encode()) > MAX_SALT_BYTES:
            return f"cache_salt must be at most {MAX_SALT_BYTES} bytes"
        return None

    def _room(self, ids: list[int]) -> int:
        """max_new_tokens 0 asks for what the request's context holds after its prompt (as
        OpenAI's chat without max_tokens); at least 1, so that _check names a prompt too long."""
        engine = self.engine
        assert engine is not None  # _open turns requests away until the engine is set
        taken = engine.compute.synthetic_context + len(ids) + engine.scheduler.reserve_extra
        return max(engine.compute.layout.max_context - taken, 1)

    async def _tokenize(self, request: pb.GenerateRequest) -> list[int]:
        assert self.engine is not None  # _open turns requests away until the engine is set
        vocab = self.engine.vocab
        assert vocab is not None  # build_engine gives the served engine its vocabulary
        prompt.check_stop(request)
        if prompt.is_long(request):
            return await asyncio.to_thread(prompt.tokenize, request, vocab)
        return prompt.tokenize(request, vocab)

    async def _open(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> GenRequest:
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is starting")
        assert self.engine is not None  # context.abort raised (grpc is untyped: mypy cannot see)
        if self.engine.failure is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(self.engine.failure))
        if request.resume_request_id:
            # Bounded before any lookup: the NOT_FOUND message names the id, and a huge one
            # would not fit in the status metadata.
            bad_id = id_problem("resume_request_id", request.resume_request_id)
            if bad_id is not None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, bad_id)
            try:
                return self.engine.api.resume(request.resume_request_id)
            except errors.UnknownRequest as e:
                await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        try:
            ids = await self._tokenize(request)
        except prompt.BadPrompt as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if request.max_new_tokens == 0:
            request.max_new_tokens = self._room(ids)
        bad = self._check(request, ids)
        if bad:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, bad)
        s = request.sampling
        params = SamplingParams(s.temperature, s.seed, tuple(s.stop_token_ids), tuple(s.stop))
        # Benchmarks: placeholder ids for the synthetic context, which Compute fills instead of
        # prefilling them.
        vocab = self.engine.compute.model.cfg.vocab_size
        serial = prompt_serial(ids)  # not the arrival order: runs reproduce a prompt's context
        synthetic = self.engine.scheduler.synthetic.placeholders(serial, vocab)
        assert self.engine.vocab is not None  # build_engine gives the served engine its vocabulary
        text = prompt.text_stream(request, self.engine.vocab)
        return self.engine.api.submit(
            synthetic + tuple(ids), request.max_new_tokens, params, text, request.cache_salt
        )

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        req = await self._open(request, context)
        assert self.engine is not None  # _open aborted without one
        final_sent = False
        try:
            # The id before any token: a client can resume the request even if we stop in prefill.
            await context.send_initial_metadata((("request-id", req.request_id),))
            async for ev in req.follow(0):
                last = (
                    req.finished
                    and req.finish in (Finish.LENGTH, Finish.STOP)
                    and ev.index == len(req.tokens) - 1
                )
                resp = pb.GenerateResponse(
                    request_id=req.request_id,
                    token_id=ev.token_id,
                    index=ev.index,
                    time_since_start_us=ev.time_since_start_us,
                    inter_token_us=ev.inter_token_us,
                    has_token=True,
                    text=ev.text,
                )
                if last:
                    self._finalize(resp, req)
                    final_sent = True
                yield resp
            if not final_sent:
                resp = pb.GenerateResponse(
                    request_id=req.request_id, index=len(req.tokens), text=req.tail
                )
                yield self._finalize(resp, req)
        finally:
            if not req.finished:
                log.info("client of request %s went away: cancelling it", req.request_id)
                self.engine.api.cancel(req)
        if req.finish is Finish.ERROR:
            await context.abort(FAIL_CODES[req.status], req.error)

    def _finalize(self, resp: pb.GenerateResponse, req: GenRequest) -> pb.GenerateResponse:
        c = req.counters
        resp.finished = True
        assert req.finish is not None and self.engine is not None  # a finished, served request
        resp.finish_reason = pb.FinishReason.ValueType(int(req.finish))
        resp.error_message = req.error
        queued, prefill_wait = req.waits_us()
        resp.stats.CopyFrom(
            pb.FinalStats(
                hits=c.hits,
                misses=c.misses,
                bytes_moved=c.bytes_moved,
                queued_us=queued,
                prefill_wait_us=prefill_wait,
            )
        )
        # Usage counts the client's prompt, not the synthetic context of benchmarks before it;
        # cached tokens inside that context are left out with it.
        synthetic = self.engine.compute.synthetic_context
        resp.usage.CopyFrom(
            pb.Usage(
                prompt_tokens=req.prompt_len - synthetic,
                cached_tokens=max(req.cached_tokens - synthetic, 0),
                generated_tokens=len(req.tokens),
            )
        )
        return resp
