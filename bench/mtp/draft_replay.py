"""BENCHMARK-ONLY draft source: replays a recorded greedy run, so speculative decoding can be
measured at a set acceptance rate on a random-weight model (whose MTP layer's drafts are almost
never accepted). It proposes the target's own next tokens, recorded by a run without
speculation: a verify step then accepts every draft (100%), or every draft but those made wrong
on purpose (`wrong_every`). The MTP layer still runs and its cost stays in each step; only its
proposals are replaced. Never a serving configuration: label every result that uses it.

    python -m engine_client serve --speculative mtp --draft-tokens 2 \\
        --draft-source 'bench.mtp.draft_replay:replay_source:{"path": "greedy.jsonl"}'

The recording is JSON lines {"prompt": [ids], "tokens": [ids]} (`write_recording`); a request
whose prompt is not in it gets no drafts (-1: never accepted).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch


def write_recording(path: str | Path, runs: Iterable[tuple[tuple[int, ...], list[int]]]) -> None:
    """Record (prompt, generated tokens) pairs of a greedy run."""
    with open(path, "w") as f:
        for prompt, tokens in runs:
            f.write(json.dumps({"prompt": list(prompt), "tokens": list(tokens)}) + "\n")


def read_recording(path: str | Path) -> dict[tuple[int, ...], list[int]]:
    with open(path) as f:
        return {tuple(r["prompt"]): r["tokens"] for r in map(json.loads, f) if r}


class ReplayDrafts:
    """engine_client.model.mtp.DraftSource over a recording: a table [R + 1, C + D + 1] of the
    recorded token at each position of each request slot (-1 elsewhere; row R for padding),
    filled when a request's prompt is known (`start`) and gathered in the CUDA graph."""

    def __init__(
        self,
        recording: dict[tuple[int, ...], list[int]],
        max_requests: int,
        max_context: int,
        draft_tokens: int,
        vocab_size: int,
        device: torch.device | str,
        wrong_every: int = 0,
    ) -> None:
        self.recording, self.D, self.vocab = recording, draft_tokens, vocab_size
        self.wrong_every, self.max_requests = wrong_every, max_requests
        width = max_context + draft_tokens + 1
        self.table = torch.full((max_requests + 1, width), -1, dtype=torch.int32, device=device)
        self._offsets = torch.arange(1, draft_tokens + 1, device=device)

    def start(self, req_slot: int, prompt: tuple[int, ...]) -> None:
        row = torch.full((self.table.shape[1],), -1, dtype=torch.int32)
        tokens = self.recording.get(tuple(prompt), [])[: row.shape[0] - len(prompt)]
        if tokens:
            row[len(prompt) : len(prompt) + len(tokens)] = torch.tensor(tokens, dtype=torch.int32)
        if self.wrong_every:
            # Deliberate misses: the token at every wrong_every-th position, shifted by one.
            at = torch.arange(row.shape[0])
            wrong = (at % self.wrong_every == 0) & (row >= 0)
            row = torch.where(wrong, (row + 1) % self.vocab, row)
        self.table[req_slot].copy_(row)

    def __call__(self, req_slots: torch.Tensor, base: torch.Tensor, drafts: torch.Tensor) -> None:
        pad = torch.where(req_slots >= 0, req_slots, self.max_requests).long()
        at = (base.long()[:, None] + self._offsets).clamp(0, self.table.shape[1] - 1)
        drafts.copy_(self.table[pad[:, None], at])


def replay_source(
    model_cfg, layout, device: str, draft_tokens: int, path: str, wrong_every: int = 0
) -> ReplayDrafts:
    """Factory for `serve --draft-source bench.mtp.draft_replay:replay_source:{"path": ...}`
    (BENCHMARK-ONLY; optional "wrong_every": N makes every N-th position's draft wrong)."""
    return ReplayDrafts(
        read_recording(path),
        layout.max_requests,
        layout.max_context,
        draft_tokens,
        model_cfg.vocab_size,
        device,
        wrong_every,
    )
