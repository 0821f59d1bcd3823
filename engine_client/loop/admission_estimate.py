"""The admission limit's measurements (engine_client.loop.admission_limit): the buckets of batch
sizes it climbs over, and per bucket an estimate of the decode throughput there."""

from __future__ import annotations

from dataclasses import dataclass

# A bucket spans 1/BUCKET_SHARE of its batch sizes (12.5%): the overshoot of a refused up-trial.
BUCKET_SHARE = 8


@dataclass
class Estimate:
    """One bucket's batch size and decode seconds: EWMAs over its current visit."""

    rows: float = 0.0
    seconds: float = 0.0
    samples: int = 0  # in this visit
    last: int = -1  # observed step of the last sample

    @property
    def tok_s(self) -> float:
        """Decode rows per second (0: never measured)."""
        return self.rows / self.seconds if self.seconds else 0.0

    def add(self, rows: int, seconds: float, alpha: float) -> None:
        if self.samples == 0:
            self.rows, self.seconds = rows, seconds  # a new visit starts afresh
        else:
            self.rows += alpha * (rows - self.rows)
            self.seconds += alpha * (seconds - self.seconds)
        self.samples += 1


def bucket_lows(capacity: int, least: int, padded: tuple[int, ...]) -> list[int]:
    """The smallest batch of each bucket: widths of 1/BUCKET_SHARE of N, at least `least`, but
    cut after every padded size (no bucket mixes two padded sizes)."""
    lows = [1]
    while True:
        low = lows[-1] + max(least, -(-lows[-1] // BUCKET_SHARE))
        low = min([low] + [p + 1 for p in padded if lows[-1] <= p < low])
        if low > capacity:
            return lows
        lows.append(low)
