"""BENCHMARK-ONLY synthetic acceptance of speculative drafts (`serve --speculative-acceptance`),
as vLLM's synthetic rejection sampler: the MTP layer of random weights drafts tokens the target
almost never agrees with, so speculation could not be measured at V3.2's real acceptance; this
rule sets the acceptance instead. Everything else stays real: the MTP layer drafts, the verify
step runs D + 1 rows per request through every layer with the union swap plan, and the rejected
rows are rolled back as for real rejections.

The rule. In a verify step of a request at position p, draft i (at position p + 1 + i) is
accepted with probability rates[i] given that drafts 0 .. i - 1 were (conditional rates; a
position past the given ones repeats the last rate); a is the accepted prefix. A draw is a
uniform of `derive(request key, draft position)`, the request key a hash of the acceptance
seed, the request's sampling seed and its prompt: a request's accepted counts depend on nothing
else (not on the batch, the KV mode, overlap, the device or a revival), so a run repeats.

The tokens emitted: the accepted drafts d_1 .. d_a, then the target's own token of row a (the
argmax; a sampled request's drawn from p_a with the row's key), which is exactly what a verify
step emits when its drafts really match. Not the target's tokens y_0 .. y_a of the rows: row
j's input is d_j, so y_j (j >= 1) is the target's choice after d_j, not after y_{j-1}; emitting
them would leave the KV rows of d_1 .. d_a under a text that says y_0 .. y_{a-1}, and prefix
caching (pages named by their tokens), a revival's prefill and every later step would then read
KV that is not the text's. With the drafts emitted, the KV stored at p .. p + a is that of the
emitted tokens, and each step's last token is the target's greedy (or sampled) continuation of
exactly the emitted text: a teacher-forced stream. Rate 0 emits y_0 alone, plain decoding's
token; rate 1 emits the D drafts and the target's token after them.
"""

from __future__ import annotations

import hashlib
from array import array

import torch

from engine_client.loop.acceptance_rates import AcceptanceRates
from engine_client.loop.sampler import derive, sample_rows, uniform


class SyntheticAcceptance:
    """The rule on the device, in place of engine_client.loop.speculative.verify: each request
    slot's key (entry R: padding rows), set when its prompt is prefilled (`start`)."""

    def __init__(self, rates: AcceptanceRates, max_requests: int, device: torch.device) -> None:
        self.rates, self._pad = rates, max_requests
        self._rate = torch.tensor(rates.per_position, dtype=torch.float32, device=device)
        self._offsets = torch.arange(1, rates.draft_tokens + 1, device=device)
        self._keys = torch.zeros(max_requests + 1, dtype=torch.int64, device=device)

    def request_key(self, prompt: tuple[int, ...], sampling_seed: int) -> int:
        """The 32-bit key of a request's draws: its prompt (which tells streams apart) and
        sampling seed, under the acceptance seed."""
        h = hashlib.blake2b(f"{self.rates.seed}:{sampling_seed}:".encode(), digest_size=4)
        h.update(array("q", prompt).tobytes())
        return int.from_bytes(h.digest(), "little")

    def start(self, req_slot: int, prompt: tuple[int, ...], sampling_seed: int) -> None:
        """On the host, at a request's last prefill chunk: its key, for its verify steps."""
        self._keys[req_slot] = self.request_key(prompt, sampling_seed)

    def verify(
        self,
        logits: torch.Tensor,
        drafts: torch.Tensor,
        req_slots: torch.Tensor,
        positions: torch.Tensor,
        temps: torch.Tensor | None = None,
        keys: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [n (D + 1), vocab] fp32, drafts [n, D] int64 (-1: none, never accepted),
        req_slots / positions [n] (-1: padding; the step's first position); temps / keys as
        for sampling. Returns the tokens [n, D + 1] (drafts before row a, the target's from
        row a on: row a's is the one after the accepted drafts) and the accepted counts a [n]."""
        n, D = drafts.shape
        y = sample_rows(logits, temps, keys).view(n, D + 1)
        pad = torch.where(req_slots >= 0, req_slots, self._pad).long()
        at = positions.long()[:, None] + self._offsets  # each draft's position
        ok = (uniform(derive(self._keys[pad][:, None], at)) < self._rate) & (drafts >= 0)
        accepted = ok.long().cumprod(dim=1).sum(dim=1)
        nxt = torch.cat((drafts, drafts.new_full((n, 1), -1)), dim=1)
        row = torch.arange(D + 1, device=drafts.device)
        return torch.where(row < accepted[:, None], nxt, y), accepted
