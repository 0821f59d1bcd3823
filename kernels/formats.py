"""The KV row formats and indexer-key formats: one object per format, the one owner of their bytes.

A `RowFormat` is how one token's KV row of one layer (512 latent + 64 rope values) is stored in the
host tier and the hot buffers; an `IndexFormat` is how one lightning-indexer key (128 values) is
stored in the index pool. Each object carries its name, its bytes, how attention reads it, its
reference codec, and the kernel variant the Triton kernels dispatch on. `ROW_FORMATS` and
`INDEX_FORMATS` are the registries `KVLayout.row_format` / `index_format` name (contract.layout
re-exports them). Adding a format is one object here (or registered by whoever defines it) plus
its kernels: a format without a Triton variant (`kernel=None`) runs on the reference kernels.

Index pool pages: a page of P keys holds the P keys' value bytes, then their P scale bytes
(DeepSeek-V3.2's indexer cache), so every key's values start aligned; a format without a scale
(`scale_bytes=0`) is then simply stored key by key. Appends take rows of values followed by the
scale either way (`IndexFormat.encode`).

Torch-free at import (the command line and `contract.layout` read this module; torch takes
seconds to import): the codecs import torch when they run.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# The row of DeepSeek-V3.2's MLA: 512 latent values then 64 rope values per token and layer.
LATENT_DIM = 512
ROPE_DIM = 64
ROW_VALUES = LATENT_DIM + ROPE_DIM
# Dimensions of a lightning-indexer key.
INDEX_DIM = 128

# fp8 e4m3: largest finite value. fp8 rows have one fp32 scale per FP8_BLOCK latent values.
FP8_MAX = 448.0
FP8_BLOCK = 128
FP8_BLOCKS = LATENT_DIM // FP8_BLOCK
# Rows whose 128-value block is all (near) zero still get a finite scale.
FP8_AMAX_FLOOR = 1e-4
# Byte offsets of DeepSeek-V3.2's FlashMLA fp8 row: [0, 512) latent e4m3, [512, 528) the four
# fp32 scales, [528, 656) the rope values in bf16.
FP8_SCALES_AT = LATENT_DIM
FP8_ROPE_AT = FP8_SCALES_AT + 4 * FP8_BLOCKS
FP8_ROW_BYTES = FP8_ROPE_AT + 2 * ROPE_DIM

# Residency mode of a request slot (`req_mode`), fixed at admission (docs/DECISIONS.md).
MODE_FREE = 0
MODE_RESIDENT = 1
MODE_OFFLOADED = 2


class RowKernel(enum.IntEnum):
    """The variant of the Triton kernels (kv_append, sparse attention) for a row format."""

    BF16 = 0  # stored and read as the bf16 values appended
    FP8 = 1  # quantized in kv_append, dequantized in registers by attention (kernels.store.fp8_row)


class IndexKernel(enum.IntEnum):
    """The variant of the indexer kernel for an index format."""

    BF16 = 0
    FP8 = 1  # e4m3 values and one fp32 scale per key


@dataclass(frozen=True)
class RowFormat:
    """One KV row format. `quantize(rows, out)`: reference encoder of bf16 rows [n, 576] into
    stored rows out [n, row_bytes] uint8; `dequantize(raw)`: stored rows [..., row_bytes] uint8
    back to bf16 [..., 576]. Both None: rows are stored as the bf16 values themselves, and
    attention reads them as such (`attn_dtype` "bfloat16"); otherwise attention reads the stored
    bytes ("uint8") and decodes them. `kernel`: the Triton variant, None for reference only."""

    name: str
    row_bytes: int
    attn_dtype: str
    quantize: Callable[[torch.Tensor, torch.Tensor], None] | None
    dequantize: Callable[[torch.Tensor], torch.Tensor] | None
    kernel: RowKernel | None

    def __post_init__(self) -> None:
        if self.attn_dtype not in ("bfloat16", "uint8") or self.row_bytes <= 0:
            raise ValueError(f"row format {self.name}: bad dtype or size")
        if self.attn_dtype == "bfloat16" and (
            self.row_bytes != 2 * ROW_VALUES or self.quantize or self.dequantize
        ):
            raise ValueError(f"row format {self.name}: bf16 rows are {2 * ROW_VALUES} B, uncoded")

    @property
    def attn_width(self) -> int:
        """Elements per row of the tensor attention reads."""
        return self.row_bytes // (2 if self.attn_dtype == "bfloat16" else 1)

    def attn_rows(self, raw: torch.Tensor) -> torch.Tensor:
        """Stored rows (uint8, any shape whose rows are contiguous) as attention reads them:
        [rows, attn_width] of attn_dtype, a view."""
        import torch

        flat = raw.view(-1, self.row_bytes)
        return flat.view(getattr(torch, self.attn_dtype)).view(-1, self.attn_width)

    def describe(self) -> str:
        return f"{self.name} ({self.row_bytes} B)"


@dataclass(frozen=True)
class IndexFormat:
    """One indexer-key format: `value_bytes` of values, then `scale_bytes` of scale (0: none).
    `encode(keys)`: keys [n, 128] (any float) -> append rows [n, key_bytes] uint8, plain tensor
    ops (graph-safe); `decode(rows)`: append rows [..., key_bytes] -> fp32 keys [..., 128]."""

    name: str
    value_bytes: int
    scale_bytes: int
    encode: Callable[[torch.Tensor], torch.Tensor]
    decode: Callable[[torch.Tensor], torch.Tensor]
    kernel: IndexKernel | None

    def __post_init__(self) -> None:
        if self.value_bytes <= 0 or self.scale_bytes < 0:
            raise ValueError(f"index format {self.name}: bad sizes")

    @property
    def key_bytes(self) -> int:
        return self.value_bytes + self.scale_bytes

    def describe(self) -> str:
        return f"{self.name} ({self.key_bytes} B)"


def fp8_block_scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, 1 / scale) fp32 of per-block maxima: scale = 2^ceil(log2(max(amax, 1e-4) / 448)),
    the smallest power of two with amax / scale <= 448. Powers of two make x / scale and the
    dequantized fp8 * scale exact, so every implementation gets the same bytes and bf16 values."""
    import torch

    bits = amax.float().clamp(min=FP8_AMAX_FLOOR).view(torch.int32)
    # amax = m * 2^e, m in [1, 2): amax / 448 = (m / 1.75) * 2^(e - 8).
    s = (bits >> 23) - 127 - 8 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)
    return ((s + 127) << 23).view(torch.float32), ((127 - s) << 23).view(torch.float32)


def quantize_fp8_rows(rows: torch.Tensor, out: torch.Tensor) -> None:
    """rows [n, 576] (bf16, or any float: rounded to bf16 first) -> out [n, 656] uint8 fp8 rows.
    Values x / scale are clamped to +-448 and rounded to nearest even by the fp8 cast."""
    import torch

    n = rows.shape[0]
    x = rows.to(torch.bfloat16).float()
    nope = x[:, :LATENT_DIM].reshape(n, FP8_BLOCKS, FP8_BLOCK)
    scale, inv = fp8_block_scales(nope.abs().amax(dim=-1))
    q = (nope * inv[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    out[:, :FP8_SCALES_AT] = q.view(torch.uint8).reshape(n, LATENT_DIM)
    out[:, FP8_SCALES_AT:FP8_ROPE_AT] = scale.contiguous().view(torch.uint8)
    out[:, FP8_ROPE_AT:] = x[:, LATENT_DIM:].to(torch.bfloat16).contiguous().view(torch.uint8)


def dequantize_fp8_rows(raw: torch.Tensor) -> torch.Tensor:
    """fp8 rows [..., 656] uint8 -> [..., 576] bf16 (exact: fp8 * a power of two fits bf16)."""
    import torch

    raw = raw.contiguous()
    lead = raw.shape[:-1]
    q = raw[..., :FP8_SCALES_AT].view(torch.float8_e4m3fn).float()
    scale = raw[..., FP8_SCALES_AT:FP8_ROPE_AT].contiguous().view(torch.float32)
    nope = (q.reshape(*lead, FP8_BLOCKS, FP8_BLOCK) * scale[..., None]).reshape(*lead, LATENT_DIM)
    rope = raw[..., FP8_ROPE_AT:].contiguous().view(torch.bfloat16).float()
    return torch.cat((nope, rope), dim=-1).to(torch.bfloat16)


def _check_keys(keys: torch.Tensor) -> None:
    if keys.dim() != 2 or keys.shape[1] != INDEX_DIM:
        raise ValueError(f"index keys must be [n, {INDEX_DIM}], got {tuple(keys.shape)}")


def encode_bf16_keys(keys: torch.Tensor) -> torch.Tensor:
    import torch

    _check_keys(keys)
    return keys.to(torch.bfloat16).contiguous().view(torch.uint8)


def decode_bf16_keys(rows: torch.Tensor) -> torch.Tensor:
    import torch

    return rows.contiguous().view(torch.bfloat16).float()


# fp8 keys: scale = amax / 448 per key, like DeepSeek-V3.2's per-token fp8 indexer cache; keys
# that are all zero still get a finite, positive scale.
_MIN_KEY_SCALE = 1e-12


def encode_fp8_keys(keys: torch.Tensor) -> torch.Tensor:
    import torch

    _check_keys(keys)
    k = keys.float()
    scale = (k.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(_MIN_KEY_SCALE)
    q = (k / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return torch.cat((q.view(torch.uint8), scale.view(torch.uint8)), dim=1)


def decode_fp8_keys(rows: torch.Tensor) -> torch.Tensor:
    import torch

    rows = rows.contiguous()
    values = rows[..., :INDEX_DIM].view(torch.float8_e4m3fn).float()
    return values * rows[..., INDEX_DIM:].view(torch.float32)


# MLA latent + rope in bf16.
BF16_ROW = RowFormat("bf16", 2 * ROW_VALUES, "bfloat16", None, None, RowKernel.BF16)
# DeepSeek-V3.2's FlashMLA fp8 row; quantization rule in docs/DECISIONS.md.
FP8_ROW = RowFormat(
    "fp8", FP8_ROW_BYTES, "uint8", quantize_fp8_rows, dequantize_fp8_rows, RowKernel.FP8
)
BF16_KEYS = IndexFormat(
    "bf16", 2 * INDEX_DIM, 0, encode_bf16_keys, decode_bf16_keys, IndexKernel.BF16
)
FP8_KEYS = IndexFormat("fp8", INDEX_DIM, 4, encode_fp8_keys, decode_fp8_keys, IndexKernel.FP8)

ROW_FORMATS: dict[str, RowFormat] = {f.name: f for f in (BF16_ROW, FP8_ROW)}
INDEX_FORMATS: dict[str, IndexFormat] = {f.name: f for f in (BF16_KEYS, FP8_KEYS)}


def row_format(name: str) -> RowFormat:
    """The registered row format `name` (ValueError naming the known ones otherwise)."""
    if name not in ROW_FORMATS:
        raise ValueError(f"row format must be one of {sorted(ROW_FORMATS)}, got {name!r}")
    return ROW_FORMATS[name]


def index_format(name: str) -> IndexFormat:
    if name not in INDEX_FORMATS:
        raise ValueError(f"index format must be one of {sorted(INDEX_FORMATS)}, got {name!r}")
    return INDEX_FORMATS[name]
