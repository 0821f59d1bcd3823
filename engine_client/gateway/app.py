"""The gateway's HTTP application (aiohttp): OpenAI's routes over the engine's Generate.

A streamed request answers with HTTP 200 and server-sent events once the engine sent its first
response: an error before that (bad request, queue full, engine down) is a plain HTTP error in
OpenAI's shape; one after it is an `error` event, then `[DONE]`. A client that goes away ends
its handler (aiohttp's handler cancellation), which cancels the Generate call: the engine
cancels the request and frees its KV.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

from aiohttp import web

from engine_client.gateway import body, shapes
from engine_client.gateway.api_error import ApiError
from engine_client.gateway.config import GatewayConfig
from engine_client.gateway.upstream import Upstream
from proto.decode.v1 import decode_pb2 as pb

log = logging.getLogger(__name__)
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


def _event(obj: dict | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


def _ended(final: pb.GenerateResponse | None) -> pb.GenerateResponse:
    """The final response, if the request ended as a completion does (length or stop)."""
    if final is None or final.finish_reason not in shapes.FINISH:
        why = final.error_message if final is not None else ""
        raise ApiError(503, why or "the engine ended the request early", "server_error")
    return final


async def _first(responses: AsyncIterator[pb.GenerateResponse]) -> pb.GenerateResponse:
    """The stream's first response, which carries a token or ends the request as a completion
    ends. A request that failed before it (queue wait over, engine or KV service gone) is an
    ApiError with the engine's status: the engine sends its final ERROR response first and its
    gRPC status after it, and that status, not a 200 with an error event, is the HTTP answer."""
    resp = await anext(responses, None)
    if resp is None or (resp.finished and resp.finish_reason not in shapes.FINISH):
        await anext(responses, None)  # raises the engine's status, if it sends one
        _ended(resp)  # it sent none: 503
    assert resp is not None  # _ended raised for None
    return resp


class Gateway:
    def __init__(self, cfg: GatewayConfig) -> None:
        self.cfg = cfg
        self.upstream = Upstream(cfg.target, cfg.timeout)
        self.created = int(time.time())

    def app(self) -> web.Application:
        # The body is read as sent: a Content-Encoding is refused in OpenAI's shape (body.py),
        # where aiohttp's own decoding of a bad one drops the connection.
        app = web.Application(middlewares=[self._errors], handler_args={"auto_decompress": False})
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.model)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/health", self.health)
        app.on_cleanup.append(self._close)
        return app

    async def _close(self, app: web.Application) -> None:
        await self.upstream.close()

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as e:
            return web.json_response(e.body(), status=e.status)
        except web.HTTPException as e:  # unknown route, wrong method: OpenAI's shape too
            err = ApiError(e.status, f"{e.reason}: {request.method} {request.path}")
            return web.json_response(err.body(), status=e.status)
        except Exception:  # a fault of ours: still OpenAI's shape, the traceback in our log
            log.exception("%s %s failed", request.method, request.path)
            err = ApiError(500, "the gateway failed on this request", "server_error")
            return web.json_response(err.body(), status=500)

    async def health(self, request: web.Request) -> web.Response:
        """200 while the engine serves; else 503 (ApiError), so compose sees what clients do."""
        await self.upstream.health()
        return web.json_response({"status": "ok"})

    def _model(self) -> dict:
        return {
            "id": self.cfg.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "hisparse",
        }

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model()]})

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name != self.cfg.model_name:
            raise ApiError(
                404,
                f"the model {name!r} does not exist",
                "invalid_request_error",
                "model",
                "model_not_found",
            )
        return web.json_response(self._model())

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=True)

    async def _complete(self, request: web.Request, chat: bool) -> web.StreamResponse:
        c = shapes.parse(await body.read(request, chat), chat, self.cfg.max_tokens)
        c.request.cache_salt = shapes.cache_salt(request.headers)
        if c.model and c.model != self.cfg.model_name:
            raise ApiError(
                404,
                f"the model {c.model!r} does not exist (this server: {self.cfg.model_name!r})",
                param="model",
                code="model_not_found",
            )
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        async with contextlib.aclosing(self.upstream.generate(c.request)) as responses:
            if c.stream:
                return await self._stream(request, c, rid, responses)
            return await self._whole(c, rid, responses)

    async def _whole(
        self, c: shapes.Completion, rid: str, responses: AsyncIterator[pb.GenerateResponse]
    ) -> web.Response:
        text, final = [], None
        async for resp in responses:
            text.append(resp.text)
            final = resp if resp.finished else final
        out = shapes.whole(
            c, rid, int(time.time()), self.cfg.model_name, "".join(text), _ended(final)
        )
        return web.json_response(out)

    async def _stream(
        self,
        request: web.Request,
        c: shapes.Completion,
        rid: str,
        responses: AsyncIterator[pb.GenerateResponse],
    ) -> web.StreamResponse:
        resp: pb.GenerateResponse | None = await _first(responses)  # until then: HTTP status
        out = web.StreamResponse(headers=SSE_HEADERS)
        await out.prepare(request)
        created, model = int(time.time()), self.cfg.model_name
        try:
            if c.chat:
                await out.write(_event(shapes.chunk(c, rid, created, model, None, None)))
            final = None
            while resp is not None:
                if resp.text:
                    await out.write(_event(shapes.chunk(c, rid, created, model, resp.text, None)))
                final = resp if resp.finished else final
                resp = await anext(responses, None)
            last = _ended(final)
            reason = shapes.FINISH[last.finish_reason]
            await out.write(_event(shapes.chunk(c, rid, created, model, "", reason)))
            if c.include_usage:
                await out.write(_event(shapes.usage_chunk(c, rid, created, model, last.usage)))
        except ApiError as e:
            await out.write(_event(e.body()))
        await out.write(_event("[DONE]"))
        return out
