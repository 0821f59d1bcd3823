"""Token sampling on the device, so a decode step's tokens can feed the next step without a host
round trip.

Greedy rows take the argmax (lowest id on ties). A row with temperature T > 0 draws from
softmax(logits / T) by the Gumbel-max trick: argmax(logits / T + G), where G is Gumbel noise
computed, not drawn, from a 32-bit key per (request seed, token index) and the token id. So a
token is a pure function of (logits, seed, index): identical on resume, in any batch, with
overlap on or off, and no RNG state is kept anywhere.
"""

from __future__ import annotations

import hashlib

import torch

M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B1
# The acceptance uniform of a key hashes key ^ salt; a token's Gumbel noise hashes
# key + id * _GOLDEN. They coincide for one token with probability vocab / 2^32 per key.
_UNIFORM_SALT = 0x5BD1E995


def token_key(seed: int, index: int) -> int:
    """The 32-bit noise key of token `index` of a request sampled with `seed`."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


def stream_key(seed: int) -> int:
    """The 32-bit key of a request's speculative token stream (its verify rows' keys are
    derived from it on the device: engine_client.loop.speculative.row_keys)."""
    digest = hashlib.blake2b(f"{seed}:stream".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 x < 2^32, without int64 overflow (16-bit halves of c)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & M32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's finalizer: a bijection of 32-bit values that mixes every bit."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def gumbel(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel noise [n, vocab] fp32 of 32-bit keys [n] int64."""
    v = torch.arange(vocab, dtype=torch.int64, device=keys.device)
    x = _fmix32((keys[:, None] + v * _GOLDEN) & M32)
    u = ((x >> 8).float() + 0.5) * (1.0 / (1 << 24))  # in (0, 1), 24 exact bits
    return -torch.log(-torch.log(u))


def derive(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """A 32-bit key per (key, counter) pair, int64 tensors that broadcast, counters < 2^32: one
    stream per counter of a key (the synthetic acceptance's draw per draft position)."""
    return _fmix32((keys + _mul32(counters, _GOLDEN)) & M32)


def uniform(keys: torch.Tensor) -> torch.Tensor:
    """A uniform in (0, 1) fp32 per 32-bit key [n] int64, from another stream than `gumbel`'s
    noise of the same key (speculative sampling's acceptance draw)."""
    x = _fmix32((keys ^ _UNIFORM_SALT) & M32)
    return ((x >> 8).float() + 0.5) * (1.0 / (1 << 24))


def sample_rows(
    logits: torch.Tensor, temps: torch.Tensor | None = None, keys: torch.Tensor | None = None
) -> torch.Tensor:
    """Tokens [n] int64 of fp32 logits [n, vocab], on their device, with no host sync. temps [n]
    fp32 and keys [n] int64 (token_key) are needed only when some row samples (T > 0)."""
    greedy = logits.argmax(dim=-1)
    if temps is None:
        return greedy
    assert keys is not None, "sampling rows (temps given) need their keys"
    scaled = logits / temps.clamp(min=1e-6)[:, None] + gumbel(keys, logits.shape[-1])
    return torch.where(temps > 0, scaled.argmax(dim=-1), greedy)


def sample(logits: torch.Tensor, temperature: float, seed: int, index: int) -> int:
    """One token from fp32 logits [vocab] (tests and tools: reads the result on the host)."""
    if temperature == 0:
        return int(sample_rows(logits[None])[0])
    dev = logits.device
    temps = torch.tensor([temperature], dtype=torch.float32, device=dev)
    keys = torch.tensor([token_key(seed, index)], dtype=torch.int64, device=dev)
    return int(sample_rows(logits[None].float(), temps, keys)[0])
