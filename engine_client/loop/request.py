"""Per-request state of the engine.

A `GenRequest` goes waiting -> prefill -> running -> finished. Its tokens are kept so that any
number of client streams can read them from any index: a resumed stream replays what was
generated before it joined, then follows live. Sampling (engine_client.loop.sampler) is a pure
function of (logits, seed, token index), so a request resumed by another engine process draws
the same tokens without any saved RNG state.

Two counts matter with overlapped steps: `launched` is how many tokens the steps launched so far
will have produced (the scheduler's view; a speculative step counts as one until it is done, so
a lower bound while one is in flight), `len(tokens)` how many arrived on the host (the clients'
view). `last_step` is the newest launched step that reads the request's KV: its slot is
released only once that step has finished on the device.

A request failed by the loss of the KV service (`lost_kv`) can be revived once the engine has
re-attached (`revive`): its KV went with the service, so its prefill covers the prompt plus the
`replayed` tokens it had generated (`context`), and the token after them is sampled with index
`replayed`, exactly as an uninterrupted run would have drawn it.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from engine_client.text.detokenizer import TextStream


class Phase(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    REMOTE = "remote"  # admitted; a prefill engine computes its prompt (loop/remote_prefill.py)
    RUNNING = "running"
    FINISHED = "finished"


class Finish(enum.IntEnum):
    """Values equal decode.v1.FinishReason."""

    LENGTH = 1
    STOP = 2
    CANCELLED = 3
    ERROR = 4


class FailStatus(enum.Enum):
    """Why an ERROR finish happened, as the status the client gets (server.py maps it)."""

    UNAVAILABLE = "unavailable"  # the KV service or the engine is gone
    RESOURCE_EXHAUSTED = "resource_exhausted"  # waited too long for capacity
    INVALID_ARGUMENT = "invalid_argument"  # can never fit the KV capacity: never retried
    INTERNAL = "internal"  # a compute step failed


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy; seed makes a sampled generation reproducible. stop_strings end
    the request once its text contains one (the request needs a TextStream)."""

    temperature: float = 0.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")


@dataclass(frozen=True)
class TokenEvent:
    token_id: int
    index: int
    time_since_start_us: int
    inter_token_us: int
    text: str = ""


@dataclass
class RequestCounters:
    """Top-k positions of this request served from the hot buffer / copied from the host."""

    hits: int = 0
    misses: int = 0
    bytes_moved: int = 0


@dataclass
class GenRequest:
    request_id: str
    prompt: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams
    phase: Phase = Phase.WAITING
    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    slot: int = -1
    prefilled: int = 0
    finish: Finish | None = None
    error: str = ""
    status: FailStatus = FailStatus.UNAVAILABLE
    counters: RequestCounters = field(default_factory=RequestCounters)
    started: float = field(default_factory=time.monotonic)
    # When it was admitted and when its first prefill chunk launched (the scheduler's clock;
    # 0: not yet): a TTFT split into queue wait, prefill wait and its own prefill.
    admitted_at: float = 0.0
    prefill_at: float = 0.0
    cancelled: bool = False
    launched: int = 0
    last_step: int = -1
    # Text output: the detokenizer (None: ids only), the text each token released, and what
    # an end without a last token (cancel, error) released.
    text: TextStream | None = None
    texts: list[str] = field(default_factory=list)
    tail: str = ""
    # Prefix caching: the client's salt, the names of the prompt's full pages (computed once,
    # at the first admission attempt), and the prompt tokens the KV side had cached (never
    # prefilled: their pages are shared and read-only).
    cache_salt: str = ""
    prompt_hashes: tuple[bytes, ...] | None = None
    cached_tokens: int = 0
    replayed: int = 0  # generated tokens that the prefill re-creates the KV of (a revival)
    # Speculative engines: the MTP layer's drafts after the first token, as the prompt's last
    # prefill chunk made them (a prefill engine's reply carries them: prefill_servicer), and a
    # decode engine's request prefilled by a peer: the peer's, written into the slot before
    # the first verify step (step_runner; None once written).
    first_drafts: tuple[int, ...] = ()
    peer_drafts: tuple[int, ...] | None = None
    lost_kv: bool = False  # failed because the KV service was lost: revivable
    _listeners: set[asyncio.Event] = field(default_factory=set)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def context(self) -> tuple[int, ...]:
        """The tokens the prefill stores: the prompt, then the replayed tokens."""
        return self.prompt + tuple(self.tokens[: self.replayed])

    @property
    def context_len(self) -> int:
        return len(self.prompt) + self.replayed

    @property
    def finished(self) -> bool:
        return self.phase is Phase.FINISHED

    @property
    def unadmitted(self) -> bool:
        """Holds no slot (never admitted, or revived and not admitted again) and was not failed
        by a KV loss (which leaves it revivable): its end is for good, and the state file takes
        it at once (engine_client.loop.state_file)."""
        return self.slot < 0 and not self.lost_kv

    def revive(self) -> None:
        """Queue again a request that failed with its KV lost: prefill prompt + every token it
        generated, then decode on. The tokens stay; streams replay them as before. So does the
        detokenizer: the failure's end left it holding what it held (`end`, resumable), which
        goes out with the next tokens."""
        if not (self.finished and self.lost_kv):
            raise ValueError(f"request {self.request_id} did not fail by losing its KV")
        self.phase, self.finish, self.error, self.status = (
            Phase.WAITING,
            None,
            "",
            FailStatus.UNAVAILABLE,
        )
        self.slot, self.prefilled, self.launched, self.last_step = -1, 0, 0, -1
        self.admitted_at = self.prefill_at = 0.0
        self.cancelled, self.lost_kv, self.replayed = False, False, len(self.tokens)

    def add_token(self, token: int, now: float) -> Finish | None:
        """Record a generated token; return why the request ends with it, if it does."""
        self.tokens.append(token)
        self.times.append(now)
        reason = None
        if token in self.sampling.stop_token_ids:
            reason = Finish.STOP
        elif len(self.tokens) >= self.max_new_tokens:
            reason = Finish.LENGTH
        self.texts.append(self._text_of(token, reason))
        if self.text is not None and self.text.stopped:
            reason = Finish.STOP
        self._notify()
        return reason

    def _text_of(self, token: int, reason: Finish | None) -> str:
        """The text `token` releases; a stop token's own text is left out, as OpenAI does."""
        if self.text is None:
            return ""
        piece = "" if reason is Finish.STOP else self.text.push(token)
        return piece + self.text.finish() if reason is not None else piece

    def end(
        self,
        finish: Finish,
        error: str = "",
        status: FailStatus = FailStatus.UNAVAILABLE,
        resumable: bool = False,
    ) -> None:
        """resumable: the request goes on in a resumed stream (an engine stopped keeping its
        requests; a KV loss, `lost_kv`, revives it). The text the detokenizer holds (a
        character's first bytes, a stop string's prefix) is then not flushed into this
        stream's end: the resumed stream's detokenizer, fed the same tokens, releases it once,
        whole, with later tokens."""
        if self.phase is Phase.FINISHED:
            return
        self.phase, self.finish, self.error, self.status = Phase.FINISHED, finish, error, status
        if self.text is not None and not (resumable or self.lost_kv):
            self.tail = self.text.finish()  # empty after a last token's finish
        self._notify()

    def waits_us(self) -> tuple[int, int]:
        """(queue wait, prefill wait) in microseconds: receipt to admission, admission to the
        first prefill chunk's launch; 0 for what did not happen."""
        queued = self.admitted_at - self.started if self.admitted_at else 0.0
        prefill = self.prefill_at - self.admitted_at if self.prefill_at else 0.0
        return int(max(queued, 0.0) * 1e6), int(max(prefill, 0.0) * 1e6)

    def event(self, i: int) -> TokenEvent:
        t = self.times[i]
        prev = self.times[i - 1] if i else self.started
        return TokenEvent(
            self.tokens[i],
            i,
            int((t - self.started) * 1e6),
            int((t - prev) * 1e6),
            self.texts[i] if i < len(self.texts) else "",
        )

    def _notify(self) -> None:
        for ev in self._listeners:
            ev.set()

    async def follow(self, start: int = 0) -> AsyncIterator[TokenEvent]:
        """Every token from index `start`, as it is generated, until the request finishes."""
        wake = asyncio.Event()
        self._listeners.add(wake)
        try:
            i = start
            while True:
                while i < len(self.tokens):
                    yield self.event(i)
                    i += 1
                if self.finished:
                    return
                await wake.wait()
                wake.clear()
        finally:
            self._listeners.discard(wake)
