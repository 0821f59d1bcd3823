"""The pinned host buffers of one launched step (`StepBuffers`): its outputs' copies, its
sampling inputs on their way to the device, and its timing events. The step runner
(engine_client.loop.step_runner) keeps three sets and cycles them, so a step's buffers are never
rewritten before the host has read them."""

from __future__ import annotations

import torch


class StepBuffers:
    """Pinned host copies of one step's outputs, and its device timing events."""

    def __init__(
        self, rows: int, requests: int, slots: int, cuda: bool, first_drafts: tuple[int, int]
    ) -> None:
        """first_drafts: (prefill chunks, D) of a speculative engine, D = 0 without."""
        self.tokens = torch.zeros(rows, dtype=torch.int64, pin_memory=cuda)
        # Speculative engines: each prefill chunk's MTP drafts after its first token [chunks, D]
        # (None without: no zero-size pinned buffer, no copy).
        self.first_drafts = (
            torch.zeros(first_drafts, dtype=torch.int64, pin_memory=cuda)
            if first_drafts[1]
            else None
        )
        # Speculative steps: (accepted, drafted, first position) per request.
        self.spec = torch.zeros((3, requests), dtype=torch.int64, pin_memory=cuda)
        # Sampling inputs on their way to the device (pageable memory could sync the stream).
        self.temps = torch.zeros(rows, dtype=torch.float32, pin_memory=cuda)
        self.keys = torch.zeros(rows, dtype=torch.int64, pin_memory=cuda)
        self.counts = torch.zeros((slots, 3), dtype=torch.int64, pin_memory=cuda)
        self.start = torch.cuda.Event(enable_timing=True) if cuda else None
        self.end = torch.cuda.Event(enable_timing=True) if cuda else None
        # Between the prefill chunk and the decode rows: the decode part's own time.
        self.decode = torch.cuda.Event(enable_timing=True) if cuda else None
        self.cpu_start = self.cpu_end = self.cpu_decode = 0.0
