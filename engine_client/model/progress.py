"""Progress of the engine's long operations (synthetic context fill, warm-up and CUDA graph
capture): a tqdm bar when stderr is a terminal, else log lines at the start, at each quarter
and at the end, so a log file or a container's output shows how far it got."""

from __future__ import annotations

import logging
import sys
import time

from tqdm import tqdm

log = logging.getLogger("engine_client.progress")


class Progress:
    def __init__(self, what: str, total: int, unit: str = "step") -> None:
        self.what, self.total, self.unit = what, max(total, 1), unit
        self.done, self._quarter, self._started = 0, 0, time.monotonic()
        self._bar = (
            tqdm(total=self.total, desc=what, unit=unit, file=sys.stderr, leave=False)
            if sys.stderr.isatty()
            else None
        )
        if self._bar is None:
            log.info("%s: %d %ss", what, self.total, unit)

    def update(self, n: int = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
            return
        quarter = 4 * self.done // self.total
        if quarter > self._quarter and self.done < self.total:
            self._quarter = quarter
            log.info("%s: %d/%d %ss", self.what, self.done, self.total, self.unit)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        log.info("%s: done in %.1f s", self.what, time.monotonic() - self._started)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
