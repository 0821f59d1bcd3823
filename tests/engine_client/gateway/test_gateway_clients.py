"""What real OpenAI clients send to the gateway (in-process, fake engine): the real `openai`
client with every field that changes no output gets a 200, one that would change the output
and is not implemented gets a 400 naming it; bodies in another charset; bytes that are not
HTTP."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import aiohttp
import pytest

from tests.gateway_fake import FakeUpstream, finished, run, token

openai = pytest.importorskip("openai")

MESSAGES = [{"role": "user", "content": "hi"}]
# Every field that changes no output, with a value a framework would send. Chat takes them all
# as arguments; the completions method has no argument for the chat-only ones (extra_body).
HARMLESS: dict[str, Any] = {
    "user": "u-1",
    "seed": 1234,
    "n": 1,
    "logprobs": False,
    "metadata": {"team": "a"},
    "store": False,
    "service_tier": "auto",
    "parallel_tool_calls": True,
    "safety_identifier": "s-1",
    "prompt_cache_key": "k-1",
    "prompt_cache_retention": "in-memory",
}
COMPLETION_ARGS = ("user", "seed", "n")
STREAM_OPTIONS = {"include_usage": True, "include_obfuscation": False}
SCRIPT = [token("he"), token("llo"), finished()]


def _client(url: str) -> Any:
    return openai.AsyncOpenAI(base_url=url.rstrip("/") + "/v1", api_key="unused", max_retries=0)


async def _chat(url: str, stream: bool) -> str:
    client = _client(url)
    kw: dict[str, Any] = dict(model="hisparse", messages=MESSAGES, stream=stream, **HARMLESS)
    if not stream:
        out = await client.chat.completions.create(**kw)
        assert out.usage.completion_tokens == 1
        return out.choices[0].message.content
    chunks = [
        c async for c in await client.chat.completions.create(**kw, stream_options=STREAM_OPTIONS)
    ]
    return _streamed(chunks, lambda c: c.choices[0].delta.content or "")


async def _completion(url: str, stream: bool) -> str:
    client = _client(url)
    args = {k: v for k, v in HARMLESS.items() if k in COMPLETION_ARGS}
    extra = {k: v for k, v in HARMLESS.items() if k not in COMPLETION_ARGS}
    kw: dict[str, Any] = dict(model="hisparse", prompt="x", stream=stream, **args)
    kw["extra_body"] = extra
    if not stream:
        out = await client.completions.create(**kw)
        assert out.usage.completion_tokens == 1
        return out.choices[0].text
    chunks = [c async for c in await client.completions.create(**kw, stream_options=STREAM_OPTIONS)]
    return _streamed(chunks, lambda c: c.choices[0].text)


def _streamed(chunks: list, text_of) -> str:
    """The text of a stream whose last chunk is OpenAI's usage chunk: no choice, the usage;
    every chunk before it has usage null."""
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 1
    assert last.usage.prompt_tokens == 3 and all(c.usage is None for c in body)
    return "".join(text_of(c) for c in body)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_fields_that_change_no_output_pass_through_the_openai_client(
    chat: bool, stream: bool
) -> None:
    upstream = FakeUpstream(list(SCRIPT))
    text = run(upstream, lambda s, url: (_chat if chat else _completion)(url, stream))
    assert text == "hello"
    (request,) = upstream.requests
    assert request.sampling.seed == 1234  # honoured: the engine's sampler draws from it
    assert request.cache_salt == ""  # `user` names an end user, not a tenant: no salt


def test_the_cache_salt_header_names_the_tenant() -> None:
    """X-Cache-Salt becomes the request's cache_salt (its own namespace of cached prefixes);
    one over the engine's 128 bytes is a 400 naming the header, before the engine is asked."""
    upstream = FakeUpstream()

    async def ask(s: aiohttp.ClientSession, url: str) -> list[Any]:
        answers: list[Any] = []
        for salt in ("tenant-a", "t" * 128, "x" * 129):
            client = _client(url)
            try:
                answers.append(
                    await client.completions.create(
                        model="hisparse", prompt="x", extra_headers={"X-Cache-Salt": salt}
                    )
                )
            except openai.BadRequestError as e:
                answers.append(e)
        return answers

    *served, refused = run(upstream, ask)
    assert [r.cache_salt for r in upstream.requests] == ["tenant-a", "t" * 128]
    assert refused.status_code == 400 and refused.param == "X-Cache-Salt"


def test_no_seed_is_a_fresh_one_each_request() -> None:
    upstream = FakeUpstream()

    async def two(s: aiohttp.ClientSession, url: str) -> None:
        for _ in range(2):
            await _client(url).completions.create(model="hisparse", prompt="x", temperature=1)

    run(upstream, two)
    first, second = (r.sampling.seed for r in upstream.requests)
    assert first != second


REFUSED = [
    ("n", 2),
    ("logprobs", True),
    ("top_logprobs", 2),
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("response_format", {"type": "json_object"}),
    ("presence_penalty", 0.5),
    ("top_p", 0.5),
    ("logit_bias", {"5": 10}),
    ("reasoning_effort", "high"),
    ("stream_options", {"include_usage": True, "chunk_size": 4}),
]


@pytest.mark.parametrize("name, value", REFUSED, ids=[n for n, _ in REFUSED])
def test_a_field_that_would_change_the_output_is_a_400_naming_it(name: str, value: Any) -> None:
    async def ask(s: aiohttp.ClientSession, url: str) -> Any:
        kw = {name: value} | ({"stream": True} if name == "stream_options" else {})
        try:
            await _client(url).chat.completions.create(model="hisparse", messages=MESSAGES, **kw)
        except openai.BadRequestError as e:
            return e
        return None

    err = run(FakeUpstream(), ask)
    assert err is not None and err.status_code == 400
    assert err.param.startswith(name) and name in err.message


def test_a_completions_logprobs_0_is_a_400_not_false() -> None:
    """0 asks a completion for its chosen tokens' logprobs: not the same as false."""

    async def ask(s: aiohttp.ClientSession, url: str) -> Any:
        with pytest.raises(openai.BadRequestError) as e:
            await _client(url).completions.create(model="hisparse", prompt="x", logprobs=0)
        return e.value

    assert run(FakeUpstream(), ask).param == "logprobs"


def _post_raw(data: bytes, content_type: str) -> tuple[int, dict]:
    async def post(s: aiohttp.ClientSession, url: str) -> tuple[int, dict]:
        headers = {"Content-Type": content_type}
        async with s.post(url.rstrip("/") + "/v1/completions", data=data, headers=headers) as r:
            return r.status, await r.json()

    return run(FakeUpstream(), post)


BODY = {"prompt": "Grüße, señor: €", "max_tokens": 2}


@pytest.mark.parametrize("charset", ["latin-1", "utf-16", "cp1252", "UTF-8", "utf8"])
def test_a_body_is_read_in_its_charset(charset: str) -> None:
    text = json.dumps(BODY, ensure_ascii=False)
    if charset == "latin-1":
        text = text.replace("€", "\\u20ac")  # latin-1 has no euro sign: JSON's escape of it
    status, out = _post_raw(text.encode(charset), f"application/json; charset={charset}")
    assert status == 200, out


@pytest.mark.parametrize("charset", ["klingon-8", "base64", "zlib", "rot13"])
def test_a_charset_python_does_not_know_is_a_415_naming_it(charset: str) -> None:
    data = json.dumps(BODY).encode()
    status, out = _post_raw(data, f"application/json; charset={charset}")
    assert status == 415 and out["error"]["code"] == "unsupported_charset", out
    assert repr(charset)[:20] in out["error"]["message"]


def test_bytes_that_do_not_fit_their_charset_are_a_400() -> None:
    status, out = _post_raw(b'{"prompt": "\xff\xfe\xfa"}', "application/json; charset=utf-8")
    assert status == 400 and "utf-8" in out["error"]["message"], out
    status, out = _post_raw(b'{"prompt": "\x81"}', "application/json; charset=shift_jis")
    assert status == 400 and "shift_jis" in out["error"]["message"], out


NOT_HTTP = [
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(32),  # a TLS ClientHello
    b"hello there\r\n\r\n",
    b"\x00\xff" * 64 + b"\r\n\r\n",
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",  # HTTP/2 without upgrade
]


@pytest.mark.parametrize("data", NOT_HTTP, ids=["tls", "text", "binary", "h2"])
def test_bytes_that_are_not_http_get_a_400(data: bytes) -> None:
    """aiohttp's parser answers them before any handler runs: a 400 in its own plain-text
    shape, not OpenAI's (docs/CLIENT.md says so)."""

    async def send(s: aiohttp.ClientSession, url: str) -> bytes:
        host, port = url.split("//")[1].rstrip("/").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(data)
        await writer.drain()
        head = await asyncio.wait_for(reader.read(200), 10)
        writer.close()
        return head

    status_line = run(FakeUpstream(), send).split(b"\r\n")[0]
    assert re.fullmatch(rb"HTTP/1\.[01] 400 Bad Request", status_line), status_line
