"""Which session plans with the service's shared hot region (contract.shared_region, issue 40).

The region's pins and victims assume one planner: a step counter bumped at each of its decode
steps, and plan calls that follow each other on one stream. Two engines planning at once would
bump each other's steps and race on the same slots, so one session at a time holds the region:
the first to attach while it is free, until that session closes (detach, lease expiry). The
others plan their requests through their private slots only, which is always correct: a request's
`shared_len` only says which rows it may read from the region. In service mode the holder's
engine maps the region's tensors (the Attach reply exports them to it alone); in remote-swap mode
the service plans with the region for the session that holds it."""

from __future__ import annotations


class RegionLease:
    def __init__(self, present: bool, handles: list[dict] | None = None) -> None:
        self.present = present  # the layout has a region (shared_slots > 0)
        self.handles = handles or []  # its exported tensors, for the holder's engine
        self.holder: str | None = None

    def grant(self, session_id: str) -> bool:
        """Hold the region for `session_id` if it is free or already its; whether it holds it."""
        if self.present and self.holder in (None, session_id):
            self.holder = session_id
        return self.holds(session_id)

    def holds(self, session_id: str | None) -> bool:
        return self.present and session_id is not None and self.holder == session_id

    def session_closed(self, session_id: str) -> None:
        if self.holder == session_id:
            self.holder = None
