"""The synthetic context of benchmarks (`serve --synthetic-context`, `--synthetic-shared`): a
long context whose KV is filled with random rows instead of a prefill, so a benchmark starts
hundreds of long requests quickly (KVBackend.fill_synthetic)."""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass


def prompt_serial(ids: Sequence[int]) -> int:
    """The serial that names (and seeds) a request's own synthetic part: a hash of its own
    prompt, not its arrival order, so a prompt meets the same synthetic context in every run
    (bench/mtp.py replays a plain run's tokens by prompt; requests then arrive in any order)."""
    return zlib.crc32(repr(tuple(ids)).encode())


@dataclass(frozen=True)
class SyntheticContext:
    """Benchmarks: every prompt starts with `tokens` placeholder ids whose KV is filled with
    random rows instead of a prefill. The first `shared` are the same for every request (id 0,
    seed 0), so prefix caching shares them; the rest differ per prompt: their first id is a
    serial of the request's own prompt (`prompt_serial`), which also seeds their rows (equal
    ids, equal rows)."""

    tokens: int = 0
    shared: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.shared <= self.tokens:
            raise ValueError(f"shared synthetic context {self.shared} not in [0, {self.tokens}]")

    def placeholders(self, serial: int, vocab: int) -> tuple[int, ...]:
        own = self.tokens - self.shared
        mark = (1 + serial % (vocab - 1),) if own else ()
        return (0,) * self.shared + mark + (0,) * max(own - 1, 0)

    def regions(self, start: int, prompt: tuple[int, ...]) -> tuple[tuple[int, int, int], ...]:
        """(first, end, seed) of what a prefill from `start` must fill: nothing cached, or the
        whole shared part cached (a part of it cannot be: it was filled in one go)."""
        if start not in (0, self.shared):
            raise RuntimeError(f"synthetic context cached up to {start}, not 0 or {self.shared}")
        parts = ((start, self.shared, 0), (max(start, self.shared), self.tokens, -1))
        return tuple(
            (a, b, prompt[self.shared] if seed < 0 else seed) for a, b, seed in parts if b > a
        )
