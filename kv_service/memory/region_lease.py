"""Which session plans with the service's shared hot region (contract.shared_region, issue 40).

The region's pins and victims assume one planner: a step counter bumped at each of its decode
steps, and plan calls that follow each other on one stream. Two engines planning at once would
bump each other's steps and race on the same slots, so one session at a time holds the region:
the first to attach while it is free, until that session closes (detach, lease expiry). The
others plan their requests through their private slots only, which is always correct: a request's
`shared_len` only says which rows it may read from the region. In service mode the holder's
engine maps the region's tensors (the Attach reply exports them to it alone); in remote-swap mode
the service plans with the region for the session that holds it, and a remote-swap session that
attached while another held it takes the region at its first step after it was let go of
(`RemoteSwapper`).

The region is emptied whenever its planner may have changed: when its holder's session closes
(an engine killed mid-step leaves a slot keyed whose copy never ran, or a half-rebuilt index),
and when a remote-swap session re-attaches to it (here: the service is that planner, so nothing
of it runs meanwhile). An engine that plans in-stream empties it itself when it resumes a session
(engine_client/serve/restore.py): only the engine knows that it is a new process and that no
step of it is in flight, where the service cannot tell a restart from a stream drop's retry."""

from __future__ import annotations

from contract.shared_region import SharedRegion


class RegionLease:
    def __init__(self, region: SharedRegion | None, handles: list[dict] | None = None) -> None:
        self.region = region  # None: the layout has none (shared_slots = 0)
        self.handles = handles or []  # its exported tensors, for the holder's engine
        self.holder: str | None = None

    @property
    def present(self) -> bool:
        return self.region is not None

    def grant(self, session_id: str) -> bool:
        """Hold the region for `session_id` if it is free or already its; whether it holds it."""
        if self.present and self.holder in (None, session_id):
            self.holder = session_id
        return self.holds(session_id)

    def holds(self, session_id: str | None) -> bool:
        return self.present and session_id is not None and self.holder == session_id

    def session_closed(self, session_id: str) -> None:
        """The holder's session is gone: the region is free, and empty."""
        if self.holder == session_id:
            self.holder = None
            self.empty()

    def empty(self) -> None:
        """No row in the region, none pinned (its requests keep their `shared_len`)."""
        if self.region is not None:
            self.region.empty()
