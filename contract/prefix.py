"""Names of full KV pages by content, for prefix sharing: what an engine sends on Admit and
Release, and what the service indexes its cached pages by.

Page i of a token sequence (tokens [i * P, (i + 1) * P)) is named by a chained hash: the hash of
page i - 1's name and page i's token ids. Equal names mean equal token prefixes up to and
including that page (up to hash collisions: 128-bit BLAKE2b). The name holds no model identity:
the service scopes every name with the namespace of the request (the model fingerprint given at
Attach and the client's salt), so different models or tenants never share a page.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

# Bytes of one page name.
PAGE_HASH_BYTES = 16
# Most bytes of a per-client salt (Admit.cache_salt) and of a model fingerprint.
MAX_SALT_BYTES = 128
MAX_FINGERPRINT_BYTES = 128
# Name of the (empty) parent of page 0.
ROOT = b"\0" * PAGE_HASH_BYTES


def page_hashes(tokens: Sequence[int], page_size: int, parent: bytes = ROOT) -> list[bytes]:
    """Chained names of the full pages of `tokens` (a partial last page has none)."""
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    if len(parent) != PAGE_HASH_BYTES:
        raise ValueError(f"a page name has {PAGE_HASH_BYTES} bytes, got {len(parent)}")
    names, name = [], parent
    page = struct.Struct(f"<{page_size}q")
    for start in range(0, len(tokens) - page_size + 1, page_size):
        body = page.pack(*tokens[start : start + page_size])
        name = hashlib.blake2b(name + body, digest_size=PAGE_HASH_BYTES).digest()
        names.append(name)
    return names


def scoped(namespace: bytes, names: Sequence[bytes]) -> list[bytes]:
    """`names` inside `namespace`: the keys a cache may compare across requests."""
    return [hashlib.blake2b(namespace + n, digest_size=PAGE_HASH_BYTES).digest() for n in names]


def namespace(fingerprint: str, salt: str = "") -> bytes:
    """The namespace of a model fingerprint and a client salt (length-prefixed, so no pair of
    strings can spell another pair)."""
    fp, s = fingerprint.encode(), salt.encode()
    body = struct.pack("<I", len(fp)) + fp + struct.pack("<I", len(s)) + s
    return hashlib.blake2b(body, digest_size=PAGE_HASH_BYTES, person=b"hisparse-ns").digest()
