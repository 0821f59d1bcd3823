"""Which model the engine runs: its preset shapes, tokenizer, layer count and weights (a
checkpoint, or seeded random weights)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from contract.flags import setting
from contract.rules import check_settings, one_of, positive
from engine_client.model.preset import PRESETS
from engine_client.text.vocabulary import DEEPSEEK, TINY

TOKENIZER_NAMES = (DEEPSEEK, TINY)


def _tokenizer(name: str, value: str) -> None:
    if not (value in TOKENIZER_NAMES or Path(value).is_file()):
        raise ValueError(f"{name} must be {' or '.join(TOKENIZER_NAMES)} or a file")


def _existing_path(name: str, value: str) -> None:
    if not Path(value).exists():
        raise ValueError(f"{name} does not exist: {value}")


@dataclass(frozen=True)
class ModelSource:
    preset: str = setting(
        "tiny", help="model shapes: tiny, bench or v32", check=one_of(sorted(PRESETS))
    )
    tokenizer: str | None = setting(
        None,
        help="tokenizer.json of the model (any tokenizers file), or deepseek-v3.2 / "
        "deepseek-v3.2-tiny; empty: the preset's (tiny: deepseek-v3.2-tiny, else "
        "deepseek-v3.2); the model's vocabulary size follows it",
        check=_tokenizer,
    )
    num_layers: int | None = setting(
        None,
        help="override the preset's layer count; service modes adopt the service's layers "
        "and top-k (a different value here is refused)",
        check=positive,
    )
    checkpoint: str | None = setting(
        None,
        help="safetensors file or directory (DeepSeek-V3.2 names); empty: seeded random weights",
        check=_existing_path,
    )
    weight_seed: int = setting(0, help="seed of the random weights")

    def __post_init__(self) -> None:
        check_settings(self)
