"""What the churn (tests/integration/churn.py) watches while it runs: every release or admission
against the step in flight, and every finished step as it is post-processed; and how each
request must have ended."""

from __future__ import annotations

from engine_client.loop.launched_step import StepOutput
from engine_client.loop.request import Finish


def watch_slots(engine) -> list[str]:
    """Record every release of a request, or admission into a slot, that a step still in
    flight reads: the race the engine must never run."""
    control, violations = engine.control, []

    def in_flight() -> list:
        step = engine._inflight
        return step.batch.requests if step is not None else []

    async def release(request_id: str, *more) -> None:
        if any(r.request_id == request_id for r in in_flight()):
            violations.append(f"released {request_id} while a step reads it")
        await real_release(request_id, *more)

    async def admit(*args):
        adm = await real_admit(*args)
        if any(r.slot == adm.slot for r in in_flight()):
            violations.append(f"admitted into slot {adm.slot} while a step reads it")
        return adm

    real_release, real_admit = control.release, control.admit
    control.release, control.admit = release, admit
    return violations


def watch_steps(engine) -> dict:
    """Check every finished step as it is post-processed: each delivered row ran at the
    position of its request's last token (none lost or repeated in the KV), and its tokens
    are exactly what the request gained (all of them unless it ended); and record the fewest
    reserved positions any row left unused past the last one it wrote (rows of requests that
    ended meanwhile included: they run, then are dropped), the accepted and drafted counts."""
    record: dict = {"wrong": [], "spare": [], "accepted": set(), "drafted": set()}
    post, extra = engine.postprocess, engine.scheduler.reserve_extra
    D = engine.compute.draft_tokens

    def checked_post(out: StepOutput) -> None:
        accepted = out.accepted or [0] * len(out.positions)
        record["accepted"].update(out.accepted)
        record["drafted"].update(out.drafted)
        before = {}
        for req, p, a, toks in zip(out.batch.decode, out.positions, accepted, out.decode_tokens):
            last = req.prompt_len + req.max_new_tokens + extra - 1
            # Verify rows write up to p + D, the MTP layer's drafting rows p + a + D - 1.
            record["spare"].append(last - (p + max(D, a + D - 1)))
            if not (req.finished or req.cancelled):
                before[req.request_id] = (req, len(req.tokens), toks)
                if p != req.prompt_len + len(req.tokens) - 1:
                    record["wrong"].append(f"{req.request_id} ran at {p}, has {len(req.tokens)}")
        post(out)
        for req, n, toks in before.values():
            gained = req.tokens[n:]
            if gained != toks[: len(gained)] or len(gained) != len(toks) and not req.finished:
                record["wrong"].append(f"{req.request_id} gained {gained} of {toks}")

    engine.postprocess = checked_post
    return record


def depths_seen(record: dict, draft_tokens: int) -> bool:
    """Speculative steps accepted every count of drafts, 0..D, so far (a rollback at every
    depth): the churn goes on until they did, as it does until every way out was taken."""
    return record["accepted"] >= set(range(draft_tokens + 1)) if draft_tokens else True


def check_steps(record: dict, draft_tokens: int) -> None:
    assert record["wrong"] == [], record["wrong"][:5]
    assert min(record["spare"]) >= 0  # no row wrote past its request's reservation
    if draft_tokens:  # every verify step had its D drafts; the rule accepted 0..D of them
        assert record["drafted"] == {draft_tokens}, record["drafted"]
        assert record["accepted"] == set(range(draft_tokens + 1)), record["accepted"]


def ended_right(req) -> bool:
    """At most max_new_tokens; a stop token only last, and then the request stopped there;
    exactly max_new_tokens when it ended by length (a verify step's tokens past either end
    are dropped)."""
    stops = [t in req.sampling.stop_token_ids for t in req.tokens]
    return (
        len(req.tokens) <= req.max_new_tokens
        and not any(stops[:-1])
        and (req.finish is Finish.STOP) == bool(stops[-1:] == [True])
        and (req.finish is not Finish.LENGTH or len(req.tokens) == req.max_new_tokens)
    )
