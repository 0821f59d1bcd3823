"""The admission limit: how many requests may run at once before one more lowers throughput.

HiSparse fits many more requests than the baseline, but every step copies their misses from the
host tier: at poor locality (the random model's own indexer, ~87% misses) a step's time grows
faster than linearly in the batch N, and past some N* one more request lowers the tokens per
second (issue 38, item 5). The scheduler asks `allows` before each admission; the engine tells
`observe` what each decode step cost. Plain bookkeeping with step times as inputs.

The estimate: per bucket of batch sizes (1/8 of N wide, at least `samples`, so a ramp of one
prefill per step measures it in passing), EWMAs of N and of the decode time. One more request
pays while a row's marginal step time is at most the average: with linear step times, always.

The limit, a hill climb over buckets (it is the top of bucket `at`): a trial moves it one bucket
and is judged on that bucket's own `samples`. Up is kept unless throughput fell more than
`hysteresis` below the best fresh bucket under it (the best: a slow decline cannot creep in one
bucket at a time), down only where it rose by more (a tie admits more); kept trials go on at once,
so the first ramp climbs at the pace of the prefills. A refused trial returns to the best fresh
bucket, rests `explore_steps` and then tries the other direction: the limit follows the miss
rate either way. Steps run at padded sizes (the decode graphs'), so throughput is a sawtooth:
bucket tops include the padded sizes, and an up-trial refused just above one jumps to the next
one's top (docs/DECISIONS.md). Trials only while requests wait (only then does the limit bind);
nothing is preempted: after a move down, admission waits until enough requests end.

A limit whose bucket the decode batch never reaches cannot be judged by decode steps: the running
requests sit in prefill (a burst of short multi-turn prompts, one chunk a step) or end after a
few tokens. The limit does not bind the decode batch then, so after `STARVED_SAMPLES` x samples
observed steps that neither reach its bucket nor grow the batch (a ramp toward it is not
starved), while requests wait, it moves up: an up-trial
counts as kept, a down-trial as refused (issue 40 item 3: the limit had stayed at its start, 12,
for a whole multi-turn run on CPU).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from engine_client.loop.admission_estimate import Estimate, bucket_lows

# Observed steps, in multiples of `samples`, without one in the limit's bucket before the limit
# counts as not binding the decode batch (see the module doc).
STARVED_SAMPLES = 4


@dataclass(frozen=True)
class AdmissionSettings:
    """samples: steps that judge a bucket (and its least width); hysteresis: the relative change
    in throughput a trial must beat; explore_steps: observed steps between trials once settled
    (also how long a bucket's estimate stays fresh)."""

    samples: int = 6
    hysteresis: float = 0.04
    explore_steps: int = 256

    def __post_init__(self) -> None:
        if not 1 <= self.samples <= 1024:
            raise ValueError(f"samples must be in 1..1024, got {self.samples}")
        if not 0 <= self.hysteresis < 1:
            raise ValueError(f"hysteresis must be in [0, 1), got {self.hysteresis}")
        if not 1 <= self.explore_steps <= 1 << 20:
            raise ValueError(f"explore_steps must be in 1..2^20, got {self.explore_steps}")


@dataclass(frozen=True)
class _Trial:
    origin: int  # the bucket the limit came from (where a refused trial returns)
    origin_tok_s: float
    up: bool
    jump: bool = False  # to the next padded size's top


@dataclass(frozen=True)
class AdmissionView:
    """What metrics show: the limit, the estimate at its bucket, the batch of the best fresh
    estimate (0: none yet) and whether a trial is under way."""

    limit: int
    tok_s: float
    best_batch: int
    trying: bool


@dataclass
class AdmissionLimit:
    """`capacity`: the most requests the engine may run (its --max-batch). `adaptive` False: a
    fixed limit (`start`) that still estimates, for metrics. `padded`: the batch sizes the
    device pads a step to (none: every size runs as itself)."""

    capacity: int
    settings: AdmissionSettings = field(default_factory=AdmissionSettings)
    adaptive: bool = True
    start: int = 8  # the first limit (rounded up to its bucket's top): the first climb's base
    padded: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {self.capacity}")
        if not self.adaptive and self.start < 1:
            raise ValueError(f"a fixed admission limit must be >= 1, got {self.start}")
        self._lows = bucket_lows(self.capacity, self.settings.samples, self.padded)
        self._estimates = [Estimate() for _ in self._lows]
        self.at = self.bucket(self.start)
        self._fixed = min(self.start, self.capacity) if not self.adaptive else 0
        self.steps = 0
        self._trial: _Trial | None = None
        self._rest_until = 0
        self._next_up = True
        self._jump_after, self._jump_rest = 0, 1  # when the next jump may be tried, rests to wait
        # Observed steps in a row whose batch neither reached the limit's bucket nor grew past
        # the largest batch seen since the limit last moved (`_high` at bucket `_high_at`).
        self._starved, self._high, self._high_at = 0, 0, self.at

    @classmethod
    def fixed(cls, limit: int) -> AdmissionLimit:
        """At most `limit` requests, always (the estimate is still kept, for metrics)."""
        return cls(limit, adaptive=False, start=limit)

    # --- what the scheduler asks ---

    @property
    def limit(self) -> int:
        return self._fixed or self.top(self.at)

    def allows(self, running: int) -> bool:
        """May one more request be admitted beside `running` ones? (Always when none runs.)"""
        return running < self.limit

    # --- the buckets ---

    def bucket(self, n: int) -> int:
        return max(0, min(bisect.bisect_right(self._lows, n) - 1, len(self._lows) - 1))

    def top(self, b: int) -> int:
        """The largest batch of bucket b."""
        return self._lows[b + 1] - 1 if b + 1 < len(self._lows) else self.capacity

    def estimate(self, n: int) -> float:
        """Rows per second at batch n's bucket (0: never measured)."""
        return self._estimates[self.bucket(n)].tok_s

    # --- what the engine tells ---

    def observe(self, rows: int, seconds: float, waiting: bool) -> None:
        """A decode step of `rows` requests took `seconds` of decode time; `waiting`: requests
        were queued for admission at the time."""
        if rows < 1 or not seconds > 0:
            return  # an empty or unmeasured step says nothing
        self.steps += 1
        bucket = self.bucket(rows)
        est = self._estimates[bucket]
        est.add(rows, seconds, 2 / (self.settings.samples + 1))
        est.last = self.steps
        self._watch_starved(rows, bucket)
        if self.adaptive:
            self._decide(waiting)
        assert 1 <= self.limit <= self.capacity, self.limit

    def _watch_starved(self, rows: int, bucket: int) -> None:
        if self._high_at != self.at:
            self._high, self._high_at = 0, self.at
        grew, self._high = rows > self._high, max(self._high, rows)
        self._starved = 0 if grew or bucket >= self.at else self._starved + 1

    def _decide(self, waiting: bool) -> None:
        trial = self._trial
        if trial is not None and trial.jump and self._valley_too_deep(trial):
            self._judged(trial, False, waiting)
        elif self._estimates[self.at].samples < self.settings.samples:
            starved = self._starved >= STARVED_SAMPLES * self.settings.samples
            if waiting and starved and not (trial is not None and trial.jump):
                self._unbound(trial, waiting)
            return  # the limit's bucket is not measured yet
        elif trial is not None:
            self._judged(trial, self._kept(trial), waiting)
        elif waiting and self.steps >= self._rest_until and not self._try(self._next_up, waiting):
            # That way ends here (at capacity, say): the other one after a rest, not at once.
            self._next_up = not self._next_up
            self._rest_until = self.steps + self.settings.explore_steps

    def _unbound(self, trial: _Trial | None, waiting: bool) -> None:
        """The decode batch stays below the limit's bucket: the limit does not bind it, so more
        running requests cannot be shown to cost throughput. Up, as a kept up-trial would go."""
        self._starved = 0
        if trial is not None and not trial.up:
            self._judged(trial, False, waiting)
        elif trial is not None:
            self._judged(trial, True, waiting)
        else:
            self._try(True, waiting)

    def _kept(self, trial: _Trial) -> bool:
        h, tok_s = self.settings.hysteresis, self._estimates[self.at].tok_s
        if trial.up:
            return tok_s >= self._best_below(self.at) * (1 - h)
        return tok_s > trial.origin_tok_s * (1 + h)

    def _judged(self, trial: _Trial, kept: bool, waiting: bool) -> None:
        self._trial = None
        explore = self.settings.explore_steps
        if kept:
            self._jump_rest = 1 if trial.jump else self._jump_rest
            if self._try(trial.up, waiting):
                return  # on in the same direction
            if not waiting:
                self._next_up = trial.up  # stopped only because nothing waits: on once requests do
                return
        elif trial.jump:
            self._jump_after = self.steps + explore * self._jump_rest
            self._jump_rest = min(2 * self._jump_rest, 16)
        elif trial.up and self._jump(trial, waiting):
            return
        if not kept:
            self.at = self._best_up_to(trial.origin)
        self._rest_until = self.steps + explore
        self._next_up = not trial.up

    def _try(self, up: bool, waiting: bool) -> bool:
        """Start a trial one bucket up or down, if that bucket exists and the limit binds."""
        to = self.at + (1 if up else -1)
        if not waiting or not 0 <= to < len(self._lows):
            return False
        self._trial = _Trial(self.at, self._estimates[self.at].tok_s, up)
        self._estimates[to].samples = 0  # a new visit: judged on its own samples
        self.at = to
        return True

    def _jump(self, trial: _Trial, waiting: bool) -> bool:
        """Past the valley above a padded size (the trial's origin): to the next one's top."""
        if (
            not waiting
            or self.steps < self._jump_after
            or self.top(trial.origin) not in self.padded
        ):
            return False
        to = next((b for b in range(self.at + 1, len(self._lows)) if self.top(b) in self.padded), 0)
        if not to:
            return False
        self._trial = _Trial(trial.origin, trial.origin_tok_s, up=True, jump=True)
        for b in range(trial.origin + 1, to + 1):
            self._estimates[b].samples = 0  # the valley is measured afresh on the way up
        self.at = to
        return True

    def _valley_too_deep(self, trial: _Trial) -> bool:
        """Would the jump's target fall short, by a step time linear in N within one padded size
        through the lowest and highest valley buckets measured on the way up, once they span a
        third of it? Then the ramp stops there instead of overshooting to the target."""
        k, top, bottom = self.settings.samples, self.top(self.at), self.top(trial.origin)
        seen = [b for b in range(trial.origin + 1, self.at) if self._estimates[b].samples >= k]
        if not seen:
            return False
        lo, hi = self._estimates[seen[0]], self._estimates[seen[-1]]
        if 3 * (hi.rows - lo.rows) < top - bottom:
            return False
        t = hi.seconds + (hi.seconds - lo.seconds) / (hi.rows - lo.rows) * (top - hi.rows)
        best = self._best_below(trial.origin + 1)
        return t > 0 and top / t < best * (1 - self.settings.hysteresis)

    def _fresh(self, b: int) -> bool:
        est = self._estimates[b]
        return est.samples > 0 and self.steps - est.last <= self.settings.explore_steps

    def _best_below(self, b: int) -> float:
        return max((self._estimates[i].tok_s for i in range(b) if self._fresh(i)), default=0.0)

    def _best_up_to(self, b: int) -> int:
        """The fresh bucket at or below b with the best estimate (b itself if none is fresh)."""
        fresh = [i for i in range(b + 1) if self._fresh(i)] or [b]
        return max(fresh, key=lambda i: self._estimates[i].tok_s)

    def view(self) -> AdmissionView:
        fresh = [b for b in range(len(self._lows)) if self._fresh(b)]
        best = max(fresh, key=lambda b: self._estimates[b].tok_s, default=None)
        return AdmissionView(
            self.limit,
            self._estimates[self.bucket(self.limit)].tok_s,
            self.top(best) if best is not None else 0,
            self._trial is not None,
        )
