"""The engine's KV control, held in one place.

Every part that talks to the KV service (the scheduler's admissions, the releases, StepEnd
reports, the liveness checks, the recovery) asks this holder for `current` at each call rather
than keeping a copy, so that one assignment (a re-attach, or a test wrapping the control) reaches
them all.
"""

from __future__ import annotations

from engine_client.client.control import KVControl


class ControlRef:
    """`current`: the KV control every part of the engine uses now."""

    def __init__(self, control: KVControl) -> None:
        self.current = control
