"""A request body as OpenAI checks it, before shapes reads its meaning: the bytes are JSON text
(no Content-Encoding, a JSON content type, decoded by its charset: UTF-8 unless it names another
one Python knows, 415 if it names one Python does not), an object whose every string is
encodable UTF-8, whose fields are all known to the route and each of the type OpenAI documents.

Strict on purpose: a lenient reading answers 200 to what OpenAI refuses (`"stream": "no"`
would stream, `max_tokens: 1.5` would become 1) and silently ignores what it cannot do, so a
client never learns its request meant something else here.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from engine_client.gateway.api_error import ApiError

_INT, _NUMBER = (int,), (int, float)
# Field -> the JSON types it may have (null is always allowed: "use the default").
COMMON: dict[str, tuple[type, ...]] = {
    "model": (str,),
    "stream": (bool,),
    "stream_options": (dict,),
    "max_tokens": _INT,
    "temperature": _NUMBER,
    "top_p": _NUMBER,
    "seed": _INT,
    "stop": (str, list),
    # Fields that do not change the output: clients and frameworks send them, we accept them.
    "user": (str,),  # the end user's id, for the provider's abuse checks: nothing to do here
    "safety_identifier": (str,),  # user's successor
    "prompt_cache_key": (str,),  # a routing hint for the provider's prompt cache
    "prompt_cache_retention": (str,),  # how long the provider keeps it
    "metadata": (dict,),  # tags of a stored completion (see store)
    "store": (bool,),  # keep the completion in the provider's dashboard: nothing is stored here
    "service_tier": (str,),  # the provider's latency class: there is one here
    "parallel_tool_calls": (bool,),  # meaningful only with tools, which shapes refuses
    "n": _INT,
    "logprobs": (bool, int),  # chat: a flag; completions: how many
    "top_logprobs": _INT,
    "presence_penalty": _NUMBER,
    "frequency_penalty": _NUMBER,
    "logit_bias": (dict,),
    "response_format": (dict,),
}
ROUTE: dict[bool, dict[str, tuple[type, ...]]] = {
    False: COMMON | {"prompt": (str, list), "best_of": _INT, "echo": (bool,), "suffix": (str,)},
    True: COMMON | {"messages": (list,), "max_completion_tokens": _INT, "tools": (list,)},
}
JSON_TYPES = ("application/json",)


def _type_name(types: tuple[type, ...]) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}
    names |= {list: "an array", dict: "an object"}
    return " or ".join(names[t] for t in types)


def _check_type(name: str, value: Any, types: tuple[type, ...]) -> None:
    if value is None:
        return
    # bool is an int in Python but not in JSON: true is no max_tokens, 1 is no stream flag.
    fits = (bool in types) if isinstance(value, bool) else isinstance(value, types)
    if not fits:
        got = f"{value!r:.60}"
        raise ApiError.bad_request(f"{name} must be {_type_name(types)}, got {got}", name)


def check_fields(body: Any, chat: bool) -> dict:
    """The body if it is an object of known fields with their types; else ApiError 400."""
    if not isinstance(body, dict):
        raise ApiError.bad_request("the request body must be a JSON object")
    known = ROUTE[chat]
    for name, value in body.items():
        if name not in known:
            raise ApiError.bad_request(f"unrecognized request argument: {name!r:.60}", name)
        _check_type(name, value, known[name])
    return body


async def _text(request: web.Request) -> str:
    if request.headers.get("Content-Encoding", "identity").lower() != "identity":
        raise ApiError.bad_request("Content-Encoding is not supported: send the body as it is")
    kind = request.content_type  # aiohttp's default when absent: application/octet-stream
    if "Content-Type" in request.headers and kind not in JSON_TYPES:
        raise ApiError.bad_request(f"Content-Type must be application/json, got {kind!r:.60}")
    return _decode(await request.read(), request.charset or "utf-8")


def _decode(raw: bytes, charset: str) -> str:
    """The body's text in its Content-Type's charset. Python's text codecs only: bytes.decode
    refuses base64, zlib and the like (LookupError), as it does an unknown name."""
    try:
        return raw.decode(charset)  # a name with a NUL in it: ValueError, unknown too
    except (LookupError, ValueError) as e:
        if isinstance(e, UnicodeError):  # a known charset the bytes do not fit
            raise ApiError.bad_request(f"the request body is not valid {charset!r:.60}") from None
        raise ApiError(
            415,
            f"the Content-Type's charset {charset!r:.60} is not supported: send UTF-8",
            "invalid_request_error",
            "Content-Type",
            "unsupported_charset",
        ) from None


async def read(request: web.Request, chat: bool) -> dict:
    """The request's JSON object, checked by check_fields; any fault is an ApiError 4xx."""
    text = await _text(request)
    try:
        body = json.loads(text)
        # A lone UTF-16 surrogate (\\ud800) parses but cannot be encoded for the engine.
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except RecursionError:
        raise ApiError.bad_request("the request body's JSON is nested too deeply") from None
    except UnicodeEncodeError:
        raise ApiError.bad_request("the request body has a lone UTF-16 surrogate") from None
    except ValueError as e:
        raise ApiError.bad_request(f"the request body is not valid JSON: {e}") from None
    return check_fields(body, chat)
