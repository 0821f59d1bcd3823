"""The admission limit (engine_client/loop/admission_limit.py) against synthetic step-time
curves, with the engine played by a few lines: requests always wait, one is prefilled per step
while the limit allows more, one ends per step while it allows fewer. Step times are inputs
(some with noise from a seeded RNG): no clock, no device.
- linear step times: every request adds throughput, the limit climbs to capacity at the pace
  of the prefills;
- a curve whose throughput N / t(N) peaks at N*: the limit settles near N* and the engine runs
  within a few % of the peak throughput, noise or not, without wandering far;
- a curve that changes mid-run: the limit follows it down and back up;
- a step padded to the decode graphs' sizes (powers of two): the sizes just above one are a
  valley of throughput, which the limit jumps across, and it still stops at a peak;
- it moves only while requests wait; a fixed limit never moves; the buckets tile 1..capacity."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from engine_client.loop.admission_limit import STARVED_SAMPLES, AdmissionLimit, AdmissionSettings
from engine_client.loop.admission_setting import admission_limit, admission_setting

Curve = Callable[[int], float]
CAPACITY = 256


def linear(n: int) -> float:
    return 10e-3 + 1e-3 * n


def peaked(best: int) -> Curve:
    """t(N) = a + c N^2: throughput N / t(N) peaks at N* = sqrt(a / c) = `best`."""
    a = 20e-3
    return lambda n: a + a / best**2 * n * n


def drive(
    limit: AdmissionLimit, curve: Callable[[int], Curve], steps: int, noise: float = 0.0
) -> list[int]:
    """The engine, played: returns the running batch of each step."""
    rng, n, batches = random.Random(7), 0, []
    for step in range(steps):
        n += (n < limit.limit) - (n > limit.limit)
        seconds = curve(step)(n) * max(0.2, 1 + noise * rng.gauss(0, 1))
        limit.observe(n, seconds, waiting=True)
        batches.append(n)
    return batches


def efficiency(batches: list[int], curve: Curve) -> float:
    """Mean throughput over `batches` / the curve's peak throughput within capacity."""
    peak = max(n / curve(n) for n in range(1, CAPACITY + 1))
    return sum(n / curve(n) for n in batches) / len(batches) / peak


def test_linear_step_times_admit_up_to_capacity_at_the_pace_of_prefills() -> None:
    limit = AdmissionLimit(CAPACITY)
    batches = drive(limit, lambda _: linear, 600)
    assert limit.limit == CAPACITY
    # One prefill per step: capacity is reached in little more than `capacity` steps.
    assert batches.index(CAPACITY) < CAPACITY + 40
    assert min(batches[CAPACITY + 40 :]) >= CAPACITY * 7 // 8  # at most a probe below


@pytest.mark.parametrize("best", [24, 64, 160])
def test_a_throughput_peak_holds_the_limit_near_it(best: int) -> None:
    curve = peaked(best)
    limit = AdmissionLimit(CAPACITY)
    batches = drive(limit, lambda _: curve, 3000)
    settled = batches[1000:]
    assert best * 0.6 <= min(settled) and max(settled) <= best * 1.6
    assert efficiency(settled, curve) >= 0.97
    # Unlimited, the engine would run at capacity, below the peak.
    assert efficiency([CAPACITY], curve) < efficiency(settled, curve) - 0.05


@pytest.mark.parametrize("noise, least", [(0.05, 0.97), (0.1, 0.93)])
def test_noisy_step_times_do_not_make_the_limit_wander(noise: float, least: float) -> None:
    curve = peaked(64)
    limit = AdmissionLimit(CAPACITY)
    batches = drive(limit, lambda _: curve, 4000, noise)
    settled = batches[1000:]
    assert 64 * 0.6 <= min(settled) and max(settled) <= 64 * 2.2
    assert efficiency(settled, curve) >= least
    moves = sum(a != b for a, b in zip(settled, settled[1:]))
    assert moves < len(settled) // 4  # a trial now and then, not a random walk


def test_noisy_linear_step_times_still_admit_most_of_capacity() -> None:
    limit = AdmissionLimit(CAPACITY)
    batches = drive(limit, lambda _: linear, 4000, 0.05)
    assert efficiency(batches[1000:], linear) >= 0.97
    assert sum(batches[1000:]) / 3000 >= CAPACITY * 0.8


def test_the_limit_follows_a_curve_that_changes_mid_run() -> None:
    wide, narrow = peaked(128), peaked(32)
    phases = lambda step: narrow if 1500 <= step < 3000 else wide  # noqa: E731
    batches = drive(AdmissionLimit(CAPACITY), phases, 4500, 0.03)
    assert 128 * 0.6 <= min(batches[1000:1500]) and max(batches[1000:1500]) <= 128 * 1.7
    # Within a rest and a few trials of the change, down to the new peak and back up.
    assert max(batches[2200:3000]) <= 32 * 1.7 and min(batches[2200:3000]) >= 32 * 0.6
    assert efficiency(batches[2200:3000], narrow) >= 0.95
    assert min(batches[3700:]) >= 128 * 0.6 and efficiency(batches[3700:], wide) >= 0.95


PADDED = tuple(1 << i for i in range(9))  # the decode graphs' sizes: 1, 2, 4, ..., 256


def padded(n: int) -> int:
    return next(p for p in PADDED if p >= n)


def padded_linear(n: int) -> float:
    """A step pays for its padded size: throughput at a padded size rises with N, but the sizes
    just above one are much worse than it (N = 129 costs nearly what 256 does)."""
    return 2e-3 + 0.05e-3 * padded(n) + 0.01e-3 * n


def padded_peak(n: int) -> float:
    """Padded, and a superlinear part whose throughput peaks at N = 64 (a padded size)."""
    return 2e-3 + 0.03e-3 * padded(n) + 2e-3 * (n / 64) ** 2


@pytest.mark.parametrize("noise", [0.0, 0.05])
def test_padded_steps_do_not_stop_the_climb_below_capacity(noise: float) -> None:
    plain = drive(AdmissionLimit(CAPACITY), lambda _: padded_linear, 2000, noise)
    assert max(plain) < 64  # one bucket at a time, the first valley stops the climb
    limit = AdmissionLimit(CAPACITY, padded=PADDED)
    batches = drive(limit, lambda _: padded_linear, 4000, noise)
    assert max(batches[:400]) == CAPACITY  # the first ramp jumps every valley
    assert efficiency(batches[1000:], padded_linear) >= 0.96


@pytest.mark.parametrize("noise", [0.0, 0.05])
def test_padded_steps_still_stop_at_a_peak(noise: float) -> None:
    limit = AdmissionLimit(CAPACITY, padded=PADDED)
    batches = drive(limit, lambda _: padded_peak, 4000, noise)
    # Jumping the valley above 64 overshoots, but the ramp stops once it is clearly deeper
    # than the best below, long before the next padded size (128).
    assert max(batches[:400]) < 112
    assert efficiency(batches[1000:], padded_peak) >= 0.96 and limit.limit <= 80


def test_the_limit_moves_only_while_requests_wait() -> None:
    limit = AdmissionLimit(CAPACITY)
    first = limit.limit
    for _ in range(100):
        limit.observe(first, linear(first), waiting=False)
    assert limit.limit == first and limit.estimate(first) == pytest.approx(first / linear(first))
    limit.observe(first, linear(first), waiting=True)
    assert limit.limit > first  # measured and waited for: one bucket up


def test_a_limit_the_decode_batch_never_reaches_moves_up() -> None:
    """Requests wait, yet decode steps run 3 rows (the rest sit in prefill, or end at once):
    the limit's bucket gets no sample, so nothing judges it; after STARVED_SAMPLES x samples
    such steps it climbs, bucket by bucket, and stays put while nothing waits."""
    limit, k = AdmissionLimit(CAPACITY), AdmissionSettings().samples
    first = limit.limit
    for _ in range(STARVED_SAMPLES * k):  # the first step grows the batch from nothing
        limit.observe(3, linear(3), waiting=True)
    assert limit.limit == first
    limit.observe(3, linear(3), waiting=True)
    assert limit.limit > first and limit.view().trying
    climbed = limit.limit
    for _ in range(10 * STARVED_SAMPLES * k):
        limit.observe(3, linear(3), waiting=False)
    assert limit.limit == climbed
    for _ in range(10 * STARVED_SAMPLES * k):
        limit.observe(3, linear(3), waiting=True)
    assert limit.limit > climbed


def test_at_capacity_the_first_trial_down_waits_a_rest() -> None:
    """Small engines at their --max-batch keep their batching for `explore_steps` steps."""
    limit, settings = AdmissionLimit(64, start=64), AdmissionSettings()
    for _ in range(settings.samples + settings.explore_steps - 1):  # measured, then a rest
        limit.observe(64, linear(64), waiting=True)
    assert limit.limit == 64
    limit.observe(64, linear(64), waiting=True)
    assert limit.limit < 64 and limit.view().trying


def test_a_fixed_limit_never_moves_but_still_estimates() -> None:
    limit = AdmissionLimit.fixed(40)
    drive(limit, lambda _: peaked(8), 300)
    assert limit.limit == 40 and limit.allows(39) and not limit.allows(40)
    assert limit.view().best_batch > 0 and limit.estimate(40) > 0


def test_unmeasured_steps_are_ignored_and_one_request_may_always_run() -> None:
    limit = AdmissionLimit(1)
    for rows, seconds in ((0, 1.0), (1, 0.0), (1, float("nan"))):
        limit.observe(rows, seconds, waiting=True)
    assert limit.steps == 0 and limit.limit == 1 and limit.allows(0) and not limit.allows(1)


@pytest.mark.parametrize("capacity", [1, 5, 6, 7, 48, 61, 222, 4096])
@pytest.mark.parametrize("pad", [False, True])
def test_the_buckets_tile_one_to_capacity(capacity: int, pad: bool) -> None:
    sizes = tuple(p for p in PADDED if p < capacity) + (capacity,) if pad else ()
    limit = AdmissionLimit(capacity, padded=sizes)
    tops = [limit.top(b) for b in range(limit.bucket(capacity) + 1)]
    assert tops[-1] == capacity and tops == sorted(set(tops)) and set(sizes) <= set(tops)
    for b, top in enumerate(tops):
        low = tops[b - 1] + 1 if b else 1
        assert limit.bucket(low) == limit.bucket(top) == b
        assert top - low + 1 <= max(AdmissionSettings().samples, low // 8 + 1)
        # Wide enough that a ramp of one prefill per step measures it, unless a padded size or
        # capacity cuts it short.
        cut = any(low <= p <= top for p in sizes) or top == capacity
        assert cut or top - low + 1 >= AdmissionSettings().samples


def test_the_setting_names_a_limit() -> None:
    assert admission_limit("auto", 100, hisparse=True).adaptive
    assert admission_limit("auto", 100, hisparse=False).limit == 100
    assert admission_limit("off", 100, hisparse=True).limit == 100
    assert admission_limit("adaptive", 100, hisparse=False).adaptive
    fixed = admission_limit("64", 100, hisparse=True)
    assert (fixed.limit, fixed.adaptive) == (64, False)
    assert admission_limit("640", 100, hisparse=True).limit == 100
    for bad in ("0", "-3", "fast", ""):
        with pytest.raises(ValueError, match="admission_limit"):
            admission_setting("admission_limit", bad)
    with pytest.raises(ValueError, match="hysteresis"):
        AdmissionSettings(hysteresis=1.0)
