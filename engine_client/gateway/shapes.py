"""OpenAI's request and response shapes for completions and chat completions: a request body
becomes a decode.v1 GenerateRequest, the engine's answers become OpenAI JSON objects.

Supported (body.py checked each field's type first): prompt (text, token ids, or a list of one),
messages (text content, or text parts), max_tokens / max_completion_tokens, temperature, seed
(the engine's sampler is a function of it: equal seeds, equal text), stop, stream,
stream_options.include_usage. Accepted because they change no output: n = 1, logprobs false,
user, metadata, store, service_tier, parallel_tool_calls (and the few more body.py lists).
Refused with 400 naming the field (not silently ignored): n > 1, best_of > 1, echo, logprobs,
suffix, a top_p other than 1, non-zero penalties, logit_bias, tools, a response_format other
than text.

The tenant: the `X-Cache-Salt` header becomes the request's cache_salt, so requests share cached
prompt pages only with requests of the same header value (docs/CLIENT.md says why a header and
not the body's `user`).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from contract.prefix import MAX_SALT_BYTES
from engine_client.gateway.api_error import ApiError
from proto.decode.v1 import decode_pb2 as pb

INT32_MAX = (1 << 31) - 1  # the engine's token ids are int32
FINISH = {pb.LENGTH: "length", pb.STOP: "stop"}
# Fields whose presence with anything but these values asks for what the engine cannot do.
UNSUPPORTED = {
    "n": (None, 1),
    "best_of": (None, 1),
    "echo": (None, False),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "suffix": (None, ""),
    "top_p": (None, 1, 1.0),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "response_format": (None, {"type": "text"}),
}
STREAM_OPTIONS = ("include_usage", "include_obfuscation")
# The header naming the tenant whose cached prefixes a request may share.
SALT_HEADER = "X-Cache-Salt"


@dataclass(frozen=True)
class Completion:
    """One parsed request of either route."""

    chat: bool
    model: str
    request: pb.GenerateRequest
    stream: bool
    include_usage: bool


def _number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name, default)
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ApiError.bad_request(f"{name} must be a number", name)
    if isinstance(value, float) and not math.isfinite(value):  # JSON's NaN, Infinity
        raise ApiError.bad_request(f"{name} must be finite", name)
    if not lo <= value <= hi:
        raise ApiError.bad_request(f"{name} must be in [{lo}, {hi}], got {value}", name)
    return value


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ApiError.bad_request("stop must be a non-empty string or a list of them", "stop")
    return stop


def _set_prompt(req: pb.GenerateRequest, prompt: Any) -> None:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        req.text = prompt
    elif (
        isinstance(prompt, list)
        and prompt
        and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT32_MAX for t in prompt
        )
    ):
        req.token_ids.ids.extend(prompt)
    else:
        raise ApiError.bad_request(
            "prompt must be a non-empty string or list of token ids in [0, 2^31) "
            "(one prompt per request)",
            "prompt",
        )


def _text_part(part: Any) -> bool:
    return (
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
    )


def _content(message: Any, i: int) -> tuple[str, str]:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ApiError.bad_request(f"messages[{i}] must be an object with a role", "messages")
    content = message.get("content")
    if isinstance(content, list):  # text parts
        if not all(_text_part(p) for p in content):
            raise ApiError.bad_request("only text content parts are supported", "messages")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ApiError.bad_request(f"messages[{i}].content must be text", "messages")
    return message["role"], content


def _set_messages(req: pb.GenerateRequest, messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise ApiError.bad_request("messages must be a non-empty list", "messages")
    for i, message in enumerate(messages):
        role, content = _content(message, i)
        if role == "developer":  # OpenAI's newer name for system
            role = "system"
        req.chat.messages.add(role=role, content=content)


def _check_supported(body: dict) -> None:
    for name, allowed in UNSUPPORTED.items():
        value = body.get(name)
        # Typed: a completion's logprobs 0 (the chosen tokens' logprobs) is not false.
        if not any(type(value) is type(a) and value == a for a in allowed):
            raise ApiError.bad_request(f"{name}={value!r:.60} is not supported", name)


def parse(body: Any, chat: bool, default_max_tokens: int) -> Completion:
    """The request of a /v1/completions (chat False) or /v1/chat/completions body."""
    if not isinstance(body, dict):
        raise ApiError.bad_request("the request body must be a JSON object")
    _check_supported(body)
    newer = chat and body.get("max_completion_tokens") is not None
    limit = "max_completion_tokens" if newer else "max_tokens"
    # OpenAI's chat has no default limit: 0 asks the engine for the rest of the context.
    default = 0 if chat else default_max_tokens
    given = body.get(limit) is not None
    max_tokens = int(_number(body, limit, default, 1, 1 << 20)) if given else default
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
        raise ApiError.bad_request("seed must be a non-negative integer", "seed")
    req = pb.GenerateRequest(
        max_new_tokens=max_tokens,
        return_text=True,  # token-id prompts too: OpenAI answers in text
        sampling=pb.Sampling(
            temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
            seed=secrets.randbits(63) if seed is None else seed % (1 << 64),
            stop=_stop(body),
        ),
    )
    (_set_messages if chat else _set_prompt)(req, body.get("messages" if chat else "prompt"))
    model = body.get("model", "")
    return Completion(
        chat,
        model if isinstance(model, str) else "",
        req,
        body.get("stream") is True,
        _include_usage(body.get("stream_options")),
    )


def cache_salt(headers: Mapping[str, str]) -> str:
    """The tenant's salt from the SALT_HEADER header ("" without one: the shared namespace).
    Set by whatever authenticates tenants in front of the gateway, which must overwrite a
    client's own value: a salt is what keeps one tenant from timing another's cached prompts."""
    salt = headers.get(SALT_HEADER, "")
    try:
        size = len(salt.encode())
    except UnicodeEncodeError:  # undecodable header bytes, kept as surrogates
        raise ApiError.bad_request(f"{SALT_HEADER} must be UTF-8 text", SALT_HEADER) from None
    if size > MAX_SALT_BYTES:
        raise ApiError.bad_request(
            f"{SALT_HEADER} must be at most {MAX_SALT_BYTES} bytes, got {size}", SALT_HEADER
        )
    return salt


def _include_usage(options: Any) -> bool:
    """stream_options' include_usage. Its include_obfuscation (random padding of each event,
    against length side channels) changes no text: accepted and left out."""
    options = {} if options is None else options
    if not isinstance(options, dict):
        raise ApiError.bad_request("stream_options must be an object", "stream_options")
    for key, value in options.items():
        if key not in STREAM_OPTIONS:
            raise ApiError.bad_request(
                f"stream_options.{key:.60} is not supported", f"stream_options.{key:.60}"
            )
        if value is not None and not isinstance(value, bool):
            raise ApiError.bad_request(
                f"stream_options.{key} must be a boolean", f"stream_options.{key}"
            )
    return options.get("include_usage") is True


def usage(u: pb.Usage) -> dict:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.generated_tokens,
        "total_tokens": u.prompt_tokens + u.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def _envelope(
    c: Completion, rid: str, created: int, model: str, suffix: str = "", **rest: object
) -> dict:
    kind = ("chat.completion" if c.chat else "text_completion") + suffix
    return {"id": rid, "object": kind, "created": created, "model": model, **rest}


def whole(
    c: Completion, rid: str, created: int, model: str, text: str, final: pb.GenerateResponse
) -> dict:
    """The response of a request without streaming."""
    reason = FINISH.get(final.finish_reason)
    if c.chat:
        message = {"role": "assistant", "content": text}
        choice = {"index": 0, "message": message, "finish_reason": reason, "logprobs": None}
    else:
        choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
    return _envelope(c, rid, created, model, choices=[choice], usage=usage(final.usage))


def _suffix(c: Completion) -> str:
    return ".chunk" if c.chat else ""  # a text completion's chunks are text_completion too


def chunk(
    c: Completion, rid: str, created: int, model: str, text: str | None, reason: str | None
) -> dict:
    """One server-sent event of a stream. Chat: text None is the opening role delta."""
    if c.chat:
        delta = {"role": "assistant", "content": ""} if text is None else {"content": text}
        if reason is not None:
            delta = {}
        choice: dict = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}
    # With include_usage, OpenAI's every chunk has a usage field, null until the last one.
    rest = {"usage": None} if c.include_usage else {}
    return _envelope(c, rid, created, model, suffix=_suffix(c), choices=[choice], **rest)


def usage_chunk(c: Completion, rid: str, created: int, model: str, u: pb.Usage) -> dict:
    """The last event of a stream with stream_options.include_usage: no choices, the usage."""
    return _envelope(c, rid, created, model, suffix=_suffix(c), choices=[], usage=usage(u))
