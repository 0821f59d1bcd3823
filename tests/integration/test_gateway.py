"""The OpenAI-compatible gateway over the real processes (CPU): a KV service, an engine in
service mode that also runs the gateway in-process (`serve --http`), and the gateway as its own
process (`python -m engine_client gateway`). The real `openai` client drives both routes, with
streaming on and off; its text must equal the detokenized ids of the same request through gRPC.
Also: bad requests get OpenAI-shaped errors with the right HTTP codes, a full queue is 429, a
client that goes away frees its request's KV (seen in the service's stats)."""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
from collections.abc import Iterator

import aiohttp
import grpc
import pytest

from engine_client.serve.procs import ManagedProcess
from engine_client.text import vocabulary
from engine_client.text.chat import ChatMessage
from proto.decode.v1 import decode_pb2 as pb
from proto.decode.v1 import decode_pb2_grpc as pb_grpc
from tests.process_harness import (
    holds_only_cache,
    service_stats,
    start_engine,
    start_service,
    workdir,
)

openai = pytest.importorskip("openai")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

VOCAB = vocabulary.load(vocabulary.TINY)  # the tiny preset's
URL_RE = re.compile(r"gateway listening on (http://\S+)")
MODEL = "hisparse"


def wait_url(proc: ManagedProcess, timeout: float = 60.0) -> str:
    """The URL a gateway logged once it listens (it binds port 0)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = URL_RE.search(proc.log(None))
        if found:
            return found[1]
        if not proc.alive():
            break
        time.sleep(0.05)
    raise RuntimeError(f"{proc.name} never listened:\n{proc.log()}")


@pytest.fixture(scope="module")
def stack() -> Iterator[dict]:
    with workdir("gw") as path:
        svc = start_service(path)
        # One request at a time, a short queue wait: a second request meets a full queue.
        # Chunk-aligned prefix reuse: the usage tests below count cached tokens in units of
        # lcm(page size, prefill chunk), whatever ran before them (page reuse: test_prefix_*).
        eng = start_engine(
            path,
            "service",
            svc,
            extra=("--http", "127.0.0.1:0", "--max-batch", "1", "--max-queue-wait", "0.2")
            + ("--prefix-reuse-pages", "0"),
        )
        gw = ManagedProcess(
            "gateway",
            [sys.executable, "-m", "engine_client", "gateway", "--target", eng.target]
            + ["--http", "127.0.0.1:0", "--model-name", MODEL],
            f"{path}/gateway.log",
            eng.target,
            "",
        ).start()
        try:
            yield {"svc": svc, "eng": eng, "url": wait_url(gw), "inproc": wait_url(eng)}
        finally:
            assert gw.stop() == 0, gw.log()
            assert eng.stop() == 0, eng.log()
            svc.stop()


def grpc_ids(eng: ManagedProcess, request: pb.GenerateRequest) -> tuple[list[int], pb.Usage]:
    """The tokens of `request` through gRPC Generate, and its usage."""
    ids, usage = [], None
    with grpc.insecure_channel(eng.target) as channel:
        for resp in pb_grpc.DecodeServiceStub(channel).Generate(request, timeout=60):
            ids += [resp.token_id] if resp.has_token else []
            usage = resp.usage if resp.finished else usage
    return ids, usage


SAMPLING = dict(max_tokens=12, temperature=0.9, seed=7)
PROMPT = "Hello, wörld: 你好"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ✓"}]


def openai_text(client, chat: bool, stream: bool) -> tuple[str, dict]:
    if chat:
        kw = dict(model=MODEL, messages=MESSAGES, stream=stream, **SAMPLING)
        if not stream:
            out = client.chat.completions.create(**kw)
            return out.choices[0].message.content, out.usage.model_dump()
        parts, usage = [], None
        for ch in client.chat.completions.create(**kw, stream_options={"include_usage": True}):
            parts += [ch.choices[0].delta.content or ""] if ch.choices else []
            usage = ch.usage.model_dump() if ch.usage else usage
        return "".join(parts), usage
    kw = dict(model=MODEL, prompt=PROMPT, stream=stream, **SAMPLING)
    if not stream:
        out = client.completions.create(**kw)
        return out.choices[0].text, out.usage.model_dump()
    parts, usage = [], None
    for ch in client.completions.create(**kw, stream_options={"include_usage": True}):
        parts += [ch.choices[0].text] if ch.choices else []
        usage = ch.usage.model_dump() if ch.usage else usage
    return "".join(parts), usage


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_openai_client_text_equals_the_grpc_ids_detokenized(
    stack: dict, chat: bool, stream: bool
) -> None:
    client = openai.OpenAI(base_url=stack["url"] + "/v1", api_key="unused", max_retries=0)
    text, usage = openai_text(client, chat, stream)
    request = pb.GenerateRequest(
        max_new_tokens=12, sampling=pb.Sampling(temperature=0.9, seed=7), return_text=True
    )
    if chat:
        for m in MESSAGES:
            request.chat.messages.add(**m)
    else:
        request.text = PROMPT
    ids, grpc_usage = grpc_ids(stack["eng"], request)
    assert len(ids) == 12
    assert text == VOCAB.decode(ids)
    prompt_ids = (
        VOCAB.encode_chat([ChatMessage(**m) for m in MESSAGES]) if chat else VOCAB.encode(PROMPT)
    )
    assert usage["prompt_tokens"] == grpc_usage.prompt_tokens == len(prompt_ids)
    assert usage["completion_tokens"] == 12 and usage["total_tokens"] == len(prompt_ids) + 12
    # Both prompts are shorter than one prefix-reuse unit (lcm(page size, prefill chunk) = 32
    # tokens, plus the last token, which is always computed): nothing of them is ever cached.
    assert usage["prompt_tokens_details"]["cached_tokens"] == grpc_usage.cached_tokens == 0


def test_equal_seeds_give_equal_text_when_sampling(stack: dict) -> None:
    """seed reaches the engine's sampler: at temperature 0.9, one seed is one text (fields
    that change nothing else ride along), another seed another text."""
    client = openai.OpenAI(base_url=stack["url"] + "/v1", api_key="unused", max_retries=0)
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0.9, user="u", n=1)

    def text(seed: int) -> str:
        out = client.chat.completions.create(**kw, seed=seed, store=False, metadata={"a": "b"})
        return out.choices[0].message.content

    assert text(11) == text(11) != text(12)


def test_models_and_the_gateway_inside_the_engine(stack: dict) -> None:
    for url in (stack["url"], stack["inproc"]):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list()] == [MODEL]
    client = openai.OpenAI(base_url=stack["inproc"] + "/v1", api_key="unused", max_retries=0)
    out = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=4, seed=2)
    assert out.choices[0].finish_reason == "length" and out.usage.prompt_tokens == 3
    ids, _ = grpc_ids(
        stack["eng"],
        pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=[5, 6, 7]),
            max_new_tokens=4,
            sampling=pb.Sampling(temperature=1.0, seed=2),
        ),
    )
    assert out.choices[0].text == VOCAB.decode(ids)  # token-id prompts answer in text too


def test_chat_without_max_tokens_runs_to_the_context_and_models_retrieve(stack: dict) -> None:
    """OpenAI's chat has no default limit: the engine fills the request's context (defect 6)."""
    client = openai.OpenAI(base_url=stack["url"] + "/v1", api_key="unused", max_retries=0)
    assert client.models.retrieve(MODEL).id == MODEL
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens > 16
    # One more token than that is over the context: the engine's own bound, not ours.
    with pytest.raises(openai.BadRequestError, match="over the"):
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=out.usage.completion_tokens + 1
        )


def test_stop_strings_end_the_text_before_them(stack: dict) -> None:
    client = openai.OpenAI(base_url=stack["url"] + "/v1", api_key="unused", max_retries=0)
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0.9, seed=3)
    full = client.completions.create(**kw).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert len(stop) == 3 and full.find(stop) > 0
    out = client.completions.create(**kw, stop=[stop, "\x00never"])
    assert out.choices[0].text == full[: full.find(stop)]
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens < 20
    streamed = client.completions.create(**kw, stop=stop, stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == out.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "stop"


async def post(url: str, body: bytes | dict) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with aiohttp.ClientSession() as s:
        async with s.post(url, data=data, headers={"Content-Type": "application/json"}) as r:
            return r.status, await r.json()


BAD = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "n": 2}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1000}, 400, None),  # > max context
    ("/v1/completions", {"prompt": [VOCAB.size + 5]}, 400, None),  # not a token id
    ("/v1/completions", {"prompt": "x", "model": "gpt-9"}, 404, "model"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "x"}]}, 400, None),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, 400, None),
    ("/v1/nowhere", {}, 404, None),
]


@pytest.mark.parametrize("path, body, status, param", BAD)
def test_bad_requests_get_openai_errors(
    stack: dict, path: str, body: bytes | dict, status: int, param: str | None
) -> None:
    code, out = asyncio.run(post(stack["url"] + path, body))
    assert code == status, out
    assert set(out["error"]) == {"message", "type", "param", "code"} and out["error"]["message"]
    assert out["error"]["param"] == param


def test_the_openai_client_sees_a_bad_request(stack: dict) -> None:
    client = openai.OpenAI(base_url=stack["url"] + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)


async def _open_stream(s: aiohttp.ClientSession, url: str, max_tokens: int):
    body = {"prompt": [3, 4, 5], "max_tokens": max_tokens, "stream": True, "seed": 1}
    r = await s.post(url + "/v1/completions", json=body)
    assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    assert (await r.content.readline()).startswith(b"data: {")  # the first text event
    return r


def test_full_queue_is_429_and_a_gone_client_frees_its_kv(stack: dict) -> None:
    svc, url = stack["svc"], stack["url"]

    async def run() -> None:
        async with aiohttp.ClientSession() as s:
            r = await _open_stream(s, url, 120)  # holds the engine's only batch row
            assert service_stats(svc).requests == 1
            code, out = await post(url + "/v1/completions", {"prompt": "y", "max_tokens": 2})
            assert code == 429 and out["error"]["code"] == "queue_full", out
            r.close()  # the client goes away mid-stream
        deadline = time.monotonic() + 20
        while service_stats(svc).requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        # Freed: no request, no slot; pages still used are only cached prefix pages that no
        # request uses (the cancelled request's full pages, kept for reuse until evicted).
        stats = service_stats(svc)
        assert holds_only_cache(stats), stats

    asyncio.run(run())


def test_an_unreachable_engine_is_503() -> None:
    from engine_client.gateway.config import GatewayConfig
    from engine_client.gateway.server import start

    async def run() -> None:
        cfg = GatewayConfig(target="unix:/nonexistent/engine.sock", http="127.0.0.1:0")
        runner, url = await start(cfg)
        try:
            code, out = await post(url + "/v1/chat/completions", {"messages": MESSAGES})
            assert code == 503 and out["error"]["type"] == "server_error", out
        finally:
            await runner.cleanup()

    asyncio.run(run())


def test_the_gateway_bench_measures_both_routes(stack: dict) -> None:
    """bench.gateway's load and numbers on this stack (its --smoke run starts a stack of its
    own: the same code plus start-up)."""
    from bench.gateway import cli as bench

    args = bench.parse_args(["--smoke"])
    args.streams = 1  # this engine decodes one request at a time
    phases = bench.measure(args, {"grpc": stack["eng"].target, "http": stack["url"]})
    for route in ("grpc", "http"):
        (phase,) = phases[route]
        assert phase["streams"] == 1 and phase["tokens"] == 8, phase
        assert phase["text_events"] > 0 and phase["tok_per_s"] > 0, phase
    assert bench.compare(phases)["http_over_grpc_tok_per_s"] > 0


def test_tenants_named_by_the_salt_header_never_share_a_prefix(stack: dict) -> None:
    """The same prompt under X-Cache-Salt a, b, b, a: each salt's first request prefills it all
    (nothing shared across tenants), its second reuses the first's pages, as OpenAI's usage and
    the service's prefix hit counter both say."""
    client = openai.OpenAI(base_url=stack["url"] + "/v1", api_key="unused", max_retries=0)
    prompt = [(37 * i) % 900 + 50 for i in range(41)]  # 32 tokens reusable (lcm 32), 9 more

    def cached(salt: str) -> tuple[int, int]:
        before = service_stats(stack["svc"]).prefix_hit_tokens_total
        out = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=2, extra_headers={"X-Cache-Salt": salt}
        )
        hits = service_stats(stack["svc"]).prefix_hit_tokens_total - before
        return out.usage.prompt_tokens_details.cached_tokens, hits

    assert [cached(s) for s in ("tenant-a", "tenant-b", "tenant-b", "tenant-a")] == [
        (0, 0),
        (0, 0),
        (32, 32),
        (32, 32),
    ]
