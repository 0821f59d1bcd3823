"""A decode engine's prompts over its prefill peers (loop.remote_prefill), with fake peers and a
fake KV control: a prompt goes to the peer in turn; a peer down or full is passed over, the
prompt going to the next one or, with none left, prefilled here from its cached prefix on (over
whatever the failed peer wrote); a prompt mostly cached here is never sent; a refusal of the
prompt itself is the request's one error; the peer writes only the pages past a cached prefix;
a speculative peer's drafts land with the first token."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import SimpleNamespace

import torch

from contract.errors import CapacityError, KVError, LayoutMismatch, ServiceUnavailable
from engine_client.client.control import Admission
from engine_client.client.prefill_peer import Prefilled
from engine_client.client.prefill_router import PrefillRouter
from engine_client.loop.control_ref import ControlRef
from engine_client.loop.remote_prefill import LOCAL_SHARE, RemotePrefill
from engine_client.loop.request import Finish, GenRequest, Phase, SamplingParams
from engine_client.loop.step_runner import StepRunner

FIRST = 77  # the first token every working peer answers


class Peer:
    """Answers with FIRST, or raises each error of `fails` in turn first."""

    def __init__(self, target: str, *fails: KVError) -> None:
        self.target, self.fails = target, list(fails)
        self.calls: list[dict] = []

    async def prefill(self, request_id, prompt, sampling, where, pages, cached_tokens=0):
        self.calls.append({"pages": pages, "cached_tokens": cached_tokens})
        if self.fails:
            raise self.fails.pop(0)
        return Prefilled(FIRST, len(prompt), bytes_written=0)

    async def close(self) -> None:
        pass


class Control:
    def __init__(self) -> None:
        self.landed: list[tuple[str, int]] = []

    async def transfer_target(self) -> str:
        return "target"

    async def prefilled(self, request_id: str, seq_len: int) -> None:
        self.landed.append((request_id, seq_len))


def _request(name: str, prompt_len: int = 12, cached: int = 0) -> tuple[GenRequest, Admission]:
    req = GenRequest(name, tuple(range(5, 5 + prompt_len)), 4, SamplingParams())
    req.phase, req.slot, req.cached_tokens, req.prefilled = Phase.PREFILL, 0, cached, cached
    return req, Admission(name, 0, 0, prompt_len + 4, pages=(3, 1, 4), cached_tokens=cached)


def _run(peers: list[Peer], *requests: tuple[GenRequest, Admission]) -> tuple[Control, list]:
    """Start every request, let every remote prefill end; the control and the finishes."""
    control, ended = Control(), []

    async def go() -> None:
        finish: Callable[..., None] = lambda req, reason, *why: ended.append((req, reason, why))  # noqa: E731
        remote = RemotePrefill(PrefillRouter(peers), ControlRef(control), finish, asyncio.Event())  # type: ignore[arg-type]
        for req, adm in requests:
            remote.start(req, adm)
        while remote.busy:
            await asyncio.sleep(0)
            await asyncio.gather(*remote.busy.values())
        await remote.close()

    asyncio.run(go())
    return control, ended


def _landed(req: GenRequest) -> bool:
    return req.phase is Phase.RUNNING and req.tokens == [FIRST] and req.prefilled == req.prompt_len


def test_prompts_go_round_robin_and_land() -> None:
    a, b = Peer("a"), Peer("b")
    reqs = [_request(f"r{i}") for i in range(3)]
    control, ended = _run([a, b], *reqs)
    assert (len(a.calls), len(b.calls)) == (2, 1)
    assert all(_landed(req) for req, _ in reqs) and not ended
    assert control.landed == [(f"r{i}", 12) for i in range(3)]


def test_a_peer_killed_mid_call_hands_the_prompt_to_the_next_one() -> None:
    dead, live = Peer("dead", ServiceUnavailable("Prefill: connection reset")), Peer("live")
    req, adm = _request("r")
    control, ended = _run([dead, live], (req, adm))
    assert _landed(req) and not ended
    assert live.calls == [{"pages": adm.pages, "cached_tokens": 0}]  # the same pages, rewritten


def test_a_full_peer_is_waited_for_rather_than_prefilling_here() -> None:
    full = Peer("full", CapacityError("full"))
    req, _ = _request("r")
    _run([full], (req, _))
    assert _landed(req) and len(full.calls) == 2


def test_with_every_peer_down_the_prompt_is_prefilled_here() -> None:
    peers = [Peer(t, ServiceUnavailable("down")) for t in ("a", "b")]
    req, _ = _request("r", cached=4)
    control, ended = _run(peers, (req, _))
    assert not ended and not control.landed and not req.tokens
    # Prefilled here from the cached prefix on: the batch builder takes it as any admission.
    assert (req.phase, req.prefilled) == (Phase.PREFILL, 4)
    assert all(len(p.calls) == 1 for p in peers)


def test_a_prompt_mostly_cached_here_is_never_sent() -> None:
    peer = Peer("a")
    cached = int(LOCAL_SHARE * 12)
    req, adm = _request("r", cached=cached)
    _run([peer], (req, adm))
    assert not peer.calls and (req.phase, req.prefilled) == (Phase.PREFILL, cached)


def test_a_shorter_cached_prefix_goes_out_and_its_pages_are_not_written() -> None:
    peer = Peer("a")
    req, adm = _request("r", prompt_len=12, cached=4)
    _run([peer], (req, adm))
    assert _landed(req) and peer.calls == [{"pages": adm.pages, "cached_tokens": 4}]


def test_a_refusal_of_the_prompt_itself_is_one_clear_error() -> None:
    peer = Peer("a", LayoutMismatch("row_format differs"))
    req, _ = _request("r")
    control, ended = _run([peer, Peer("b")], (req, _))
    ((who, reason, why),) = ended
    assert who is req and reason is Finish.ERROR
    assert "prefill peer a" in why[0] and "row_format differs" in why[0]
    assert not control.landed


def test_a_request_cancelled_while_the_peer_works_is_not_landed() -> None:
    req, adm = _request("r")

    class Cancelling(Peer):
        async def prefill(self, *args, **kwargs):
            req.phase = Phase.FINISHED  # the client went away meanwhile
            return await super().prefill(*args, **kwargs)

    control, ended = _run([Cancelling("a")], (req, adm))
    assert not control.landed and not req.tokens and not ended


def test_a_speculative_peers_drafts_land_with_the_first_token() -> None:
    """The peer's MTP drafts after the first token are kept for the first verify step
    (step_runner writes them into the slot); a peer that drafted nothing lands an empty tuple,
    never None: the slot's drafts (a previous request's) are then overwritten with -1."""

    class Drafting(Peer):
        async def prefill(self, *args, **kwargs):
            done = await super().prefill(*args, **kwargs)
            return Prefilled(done.first_token, done.tokens, done.bytes_written, drafts=(5, 6))

    req, adm = _request("r")
    _run([Drafting("a")], (req, adm))
    assert _landed(req) and req.peer_drafts == (5, 6)
    plain, adm = _request("p")
    _run([Peer("b")], (plain, adm))
    assert _landed(plain) and plain.peer_drafts == ()


def test_the_first_verify_step_takes_the_peers_first_d_drafts_and_minus_one_past_them() -> None:
    """StepRunner._land_peer_drafts: a peer with fewer drafts than the decode engine's D leaves
    -1 (never accepted) past them, a peer with more gives its first D; a request that landed
    nothing leaves its slot alone; each request lands once."""
    compute = SimpleNamespace(model=SimpleNamespace(device=torch.device("cpu")))
    runner = StepRunner(compute, overlap=False)  # type: ignore[arg-type]
    model_runner = SimpleNamespace(D=3, drafts=torch.full((4, 3), 9, dtype=torch.int64))
    fewer, more, local = (_request(name)[0] for name in "abc")
    fewer.slot, more.slot, local.slot = 0, 2, 3
    fewer.peer_drafts, more.peer_drafts = (5,), (1, 2, 3, 4)
    runner._land_peer_drafts([fewer, more, local], model_runner)  # type: ignore[arg-type]
    assert model_runner.drafts.tolist() == [[5, -1, -1], [9, 9, 9], [1, 2, 3], [9, 9, 9]]
    assert fewer.peer_drafts is None and more.peer_drafts is None
    model_runner.drafts[0] = 8  # the verify step's own drafts from here on
    runner._land_peer_drafts([fewer], model_runner)  # type: ignore[arg-type]
    assert model_runner.drafts[0].tolist() == [8, 8, 8]
