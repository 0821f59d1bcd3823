"""Malformed requests to the gateway (in-process, fake engine): each gets a 4xx in OpenAI's
error shape, never a 500. The named cases of issue 28, then a seeded fuzz of mutations of
valid requests: wrong types, huge numbers, bad unicode, deep nesting, truncation, bad content
type or encoding, oversized bodies."""

from __future__ import annotations

import json
import random
from typing import Any

import aiohttp

from tests.gateway_fake import FakeUpstream, run

COMPLETION = {"model": "hisparse", "prompt": "hello", "max_tokens": 4, "temperature": 0}
CHAT = {"model": "hisparse", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
JSON = {"Content-Type": "application/json"}
# One malformed HTTP request: (path, body bytes, headers).
Case = tuple[str, bytes, dict[str, str]]


def _case(route: str, body: Any, headers: dict[str, str] | None = None) -> Case:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return f"/v1/{route}", data, headers or JSON


NAMED: list[Case] = [
    _case("completions", COMPLETION | {"prompt": [1, 2**31]}),
    _case("completions", COMPLETION | {"prompt": [-(2**40)]}),
    _case("completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}'),
    _case("chat/completions", b'{"messages": [{"role": "user", "content": "\\udc00"}]}'),
    _case("chat/completions", b'{"messages": [{"role": "\\ud800", "content": "x"}]}'),
    _case("completions", b'{"prompt": "a", "stop": "\\ud800"}'),
    _case("completions", b"[" * 100_000 + b"]" * 100_000),
    _case("completions", COMPLETION, JSON | {"Content-Encoding": "gzip"}),
    _case("completions", COMPLETION | {"stream": "no"}),
    _case("completions", COMPLETION | {"max_tokens": 1.5}),
    _case("completions", COMPLETION | {"model": 123}),
    _case("chat/completions", CHAT | {"response_format": {"type": "json_object"}}),
    _case("completions", b'{"prompt": "a", "max_tokens": 1' + b"0" * 400 + b"}"),
    _case("completions", b'{"prompt": "a", "temperature": 1' + b"0" * 400 + b"}"),
    # Bad unicode where the cases above do not put it: a key, a list item, a name, a map key.
    _case("completions", b'{"\\ud800": 1, "prompt": "a", "max_tokens": 2}'),
    _case("completions", b'{"prompt": ["\\ud800"], "max_tokens": 2}'),
    _case(
        "chat/completions", b'{"messages": [{"role": "user", "content": "x", "name": "\\ud800"}]}'
    ),
    _case("completions", b'{"prompt": "a", "logit_bias": {"\\ud800": 1}}'),
    # Python's json takes these non-JSON constants; OpenAI does not.
    _case("completions", b'{"prompt": "a", "temperature": NaN}'),
    _case("completions", b'{"prompt": "a", "top_p": -Infinity}'),
    # A JSON body that is not an object, and encodings other than gzip.
    _case("completions", b"[]"),
    _case("completions", b"null"),
    _case("completions", COMPLETION, JSON | {"Content-Encoding": "br"}),
    _case("completions", COMPLETION, JSON | {"Content-Encoding": "deflate"}),
]

# Per field, values of the wrong type or out of range.
BAD_VALUES: dict[str, list[Any]] = {
    "model": [123, [], True, {"a": 1}, "other-model"],
    "stream": ["no", 1, 0, [], {}],
    "max_tokens": [1.5, "16", True, -1, 0, 10**30, 1e999, []],
    "temperature": ["1", True, -0.5, 1e300, 10**400, [], float("nan")],
    "seed": [1.5, "1", -1, True],
    "stop": [1, [1], "", [""], {}, [None]],
    "prompt": [[], "", [2**31], [-1], [10**20], [1.5], ["a", 1], True, [[1], [2]], None],
    "messages": [
        [],
        "hi",
        [{"content": "x"}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": [{"type": "image_url"}]}],
        [{"role": "user", "content": [{"type": "text", "text": 5}]}],
        [7],
        None,
    ],
    "stream_options": ["x", {"include_usage": "yes"}, []],
    "n": [2, "1", 1.0],
    "logprobs": [5, "x"],
    "response_format": [{"type": "json_object"}, "text"],
    "tools": [[{"type": "function"}]],
    "unknown_field": [1, "x"],
}
CONTENT_TYPES = ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"]
ENCODINGS = ["gzip", "br", "deflate", "compress"]


def _wrong_type(rng: random.Random) -> Case:
    chat = rng.random() < 0.5
    base = dict(CHAT if chat else COMPLETION)
    names = [n for n in BAD_VALUES if (n != "prompt" or not chat) and (n != "messages" or chat)]
    name = rng.choice(names)
    base[name] = rng.choice(BAD_VALUES[name])
    text = json.dumps(base, allow_nan=True).encode()
    return _case("chat/completions" if chat else "completions", text)


def _transport(rng: random.Random) -> Case:
    text = json.dumps(COMPLETION).encode()
    kind = rng.randrange(6)
    if kind == 0:
        return _case("completions", text[: rng.randrange(len(text))])  # truncated
    if kind == 1:
        cut = rng.randrange(len(text))
        return _case("completions", text[:cut] + rng.choice([b"\xff", b"\xc3", b"\xed\xa0\x80"]))
    if kind == 2:
        depth = rng.choice([500, 5000, 200_000])
        return _case("completions", b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}")
    if kind == 3:
        return _case("completions", text, {"Content-Type": rng.choice(CONTENT_TYPES)})
    if kind == 4:
        return _case("completions", text, JSON | {"Content-Encoding": rng.choice(ENCODINGS)})
    top = rng.choice([b"[]", b"1", b'"x"', b"null", b"", b"{}", b'{"prompt": "\\ud8'])
    return _case("completions", top)


def fuzz_cases(count: int, seed: int) -> list[Case]:
    rng = random.Random(seed)
    cases = [(_wrong_type if rng.random() < 0.6 else _transport)(rng) for _ in range(count)]
    huge = b'{"prompt": "' + b"a" * (2 << 20) + b'"}'
    return cases + [_case("completions", huge)] * 3  # over the 1 MiB body limit


async def _answers(session: aiohttp.ClientSession, url: str, cases: list[Case]) -> list[tuple]:
    out = []
    for path, data, headers in cases:
        async with session.post(url + path, data=data, headers=headers) as resp:
            out.append((path, data[:120], headers, resp.status, await resp.text()))
    return out


def _is_openai_error(status: int, text: str) -> bool:
    try:
        error = json.loads(text)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    shape = set(error) == {"message", "type", "param", "code"} and bool(error["message"])
    return 400 <= status < 500 and shape


def _refused(cases: list[Case]) -> list[tuple]:
    """The answers that are not a 4xx in OpenAI's error shape."""

    async def body(session: aiohttp.ClientSession, url: str) -> list[tuple]:
        return await _answers(session, url.rstrip("/"), cases)

    answers = run(FakeUpstream(), body)
    return [a for a in answers if not _is_openai_error(a[3], a[4])]


def test_valid_requests_pass_so_the_refusals_below_mean_something() -> None:
    cases = [_case("completions", COMPLETION), _case("chat/completions", CHAT)]
    cases.append(_case("completions", COMPLETION | {"prompt": [1, 2**31 - 1], "stream": False}))

    async def body(session: aiohttp.ClientSession, url: str) -> list[tuple]:
        return await _answers(session, url.rstrip("/"), cases)

    assert [a[3] for a in run(FakeUpstream(), body)] == [200, 200, 200]


def test_the_named_malformed_requests_get_openai_400s() -> None:
    assert _refused(NAMED) == []


def test_a_fuzz_of_malformed_requests_gets_only_openai_4xx() -> None:
    cases = fuzz_cases(560, seed=28)
    assert len(cases) >= 500
    assert _refused(cases) == []
