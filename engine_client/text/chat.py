"""Chat messages to prompt text: DeepSeek-V3.1/V3.2's chat format in non-thinking mode.

    <BOS>{system prompts, joined by a blank line}
    <｜User｜>{user}<｜Assistant｜></think>{assistant}<EOS>   (each earlier turn)
    <｜User｜>{user}<｜Assistant｜></think>                      (the turn to generate)

A tokenizer without DeepSeek's role tokens gets a plain-text format ("User: ...", "Assistant:")
so that `--tokenizer PATH` works with any tokenizer.json; neither is a Jinja chat template.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenizers import Tokenizer

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"chat role must be one of {', '.join(ROLES)}, got {self.role!r}")


@dataclass(frozen=True)
class ChatFormat:
    """The markers around each part of a chat; empty strings where a format has none."""

    bos: str
    eos: str
    user: str
    assistant: str
    # Opens the assistant's answer after its role marker (V3.2: no thinking part).
    answer: str
    system_sep: str = "\n\n"

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer) -> ChatFormat:
        markers = (DEEPSEEK.bos, DEEPSEEK.eos, DEEPSEEK.user, DEEPSEEK.assistant, DEEPSEEK.answer)
        if all(tokenizer.token_to_id(m) is not None for m in markers):
            return DEEPSEEK
        return PLAIN

    def render(self, messages: Sequence[ChatMessage]) -> str:
        if not messages or messages[-1].role != "user":
            raise ValueError("a chat must end with a user message")
        system = [m.content for m in messages if m.role == "system"]
        parts = [self.bos, self.system_sep.join(system)]
        after_user = False
        for m in messages:
            if m.role == "user":
                parts += [self.user, m.content, self.assistant, self.answer]
            elif m.role == "assistant":
                # An answer opens its own turn unless a user message just did.
                opening = [] if after_user else [self.assistant, self.answer]
                parts += opening + [m.content, self.eos]
            after_user = m.role == "user"
        return "".join(parts)


DEEPSEEK = ChatFormat(
    bos="<｜begin▁of▁sentence｜>",
    eos="<｜end▁of▁sentence｜>",
    user="<｜User｜>",
    assistant="<｜Assistant｜>",
    answer="</think>",
)
PLAIN = ChatFormat(bos="", eos="\n\n", user="User: ", assistant="\n\nAssistant:", answer=" ")
