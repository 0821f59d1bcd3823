"""Acceptance of a verify step's drafts, on the device (no host round trip).

Each request brings D drafts d_1..d_D and D + 1 rows of logits; row j scores the token after
the row's input (the last accepted token, then d_1, ..., d_D). Per row the target picks y_j:
- greedy (temperature 0): y_j = argmax; draft d_{j+1} is accepted when it equals y_j. So the
  tokens taken, y_0 .. y_a, are exactly those greedy decoding one token per step would give
  (given the same logits);
- sampled (T > 0): standard speculative sampling with a one-hot draft distribution (drafts are
  the MTP layer's argmax): d_{j+1} is accepted with probability p_j(d_{j+1}), p_j =
  softmax(logits_j / T), drawn with u_j, a uniform from the row's token key (another stream
  than its Gumbel noise); else y_j is drawn from p_j with d_{j+1} removed, by Gumbel-max over
  the other tokens. P(y_j = x) = p(d) [x = d] + (1 - p(d)) p(x) / (1 - p(d)) [x != d] = p(x):
  the target's distribution, exactly. A row without a draft (or after the last) samples p_j.
a = the length of the prefix of accepted drafts; the step yields y_0 .. y_a (a + 1 tokens).
Row j's token key is derived on the device from the request's stream key and the position of
the token it yields (`row_keys`): a verify step's positions may be known on the device only
(overlapped steps), so its keys cannot come from the host as plain decoding's token_key does.
Still a pure function of (seed, position), so a resumed or revived request draws the same.
"""

from __future__ import annotations

import torch

from engine_client.loop.sampler import derive, gumbel, uniform


def reserve_extra(draft_tokens: int) -> int:
    """Tokens admission reserves beyond prompt + max_new_tokens for speculative steps. The
    engine launches a verify step while the step before it is in flight, counting that one
    as a single token (engine_client.loop.batch_builder), so it launches a step while at most
    max_new - 2 tokens are known to be out and the step in flight may then end at up to
    max_new + D - 1: the new step starts at position p <= prompt + max_new + D - 2, writes KV
    up to p + D, and the MTP layer's drafting rows reach p + a + D - 1 <= p + 2 D - 1. Without
    overlap the last D of these stay unused; one reservation either way, so a request resumed
    by an engine started with the other --overlap fits its held reservation."""
    return max(0, 3 * draft_tokens - 2)


def row_keys(stream_keys: torch.Tensor, positions: torch.Tensor, rows: int) -> torch.Tensor:
    """The token keys [n rows] of a verify step's rows: stream_keys [n rows] (each request's
    stream_key on each of its rows), positions [n] the requests' first positions; row j yields
    the token at position + j + 1, its key's counter."""
    at = positions.long()[:, None] + torch.arange(1, rows + 1, device=positions.device)
    return derive(stream_keys, at.view(-1))


def verify(
    logits: torch.Tensor,
    drafts: torch.Tensor,
    temps: torch.Tensor | None = None,
    keys: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [n (D + 1), vocab] fp32 (a request's rows consecutive), drafts [n, D] int64 (-1:
    none); temps / keys [n (D + 1)] per row, needed only when some row samples. Returns the
    target's tokens y [n, D + 1] int64 and the accepted drafts a [n] int64."""
    n, D = drafts.shape
    greedy = logits.argmax(dim=-1).view(n, D + 1)
    nxt = torch.cat((drafts, drafts.new_full((n, 1), -1)), dim=1)  # the draft each row checks
    if temps is None:
        y, ok = greedy, (greedy == nxt) & (nxt >= 0)
    else:
        y, ok = _sampled(logits, nxt, temps, keys)
        sampled = (temps > 0).view(n, D + 1)
        y = torch.where(sampled, y, greedy)
        ok = torch.where(sampled, ok, (greedy == nxt) & (nxt >= 0))
    accepted = ok[:, :D].long().cumprod(dim=1).sum(dim=1)
    return y, accepted


def _sampled(
    logits: torch.Tensor, nxt: torch.Tensor, temps: torch.Tensor, keys: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling of every row (greedy rows are replaced by the caller)."""
    assert keys is not None, "sampled rows need their token keys"
    n, G = nxt.shape
    scaled = logits / temps.clamp(min=1e-6)[:, None]
    d = nxt.view(-1)
    has = d >= 0
    p_d = torch.softmax(scaled, dim=-1).gather(1, d.clamp(min=0)[:, None])[:, 0]
    ok = has & (uniform(keys) < p_d)
    noise = scaled + gumbel(keys, logits.shape[-1])
    # The residual: the target without the rejected draft (a row without a draft: all of it).
    masked = noise.scatter(1, d.clamp(min=0)[:, None], float("-inf"))
    resample = torch.where(has[:, None], masked, noise).argmax(dim=-1)
    y = torch.where(ok, d, resample)
    return y.view(n, G), ok.view(n, G)
