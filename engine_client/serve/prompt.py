"""A Generate request's prompt as token ids, and its text output: decode.v1's prompt oneof
(token ids, text, chat messages) through the engine's vocabulary.

Text and chat prompts are tokenized here, on a worker thread for long ones (the server calls
`tokenize` through asyncio.to_thread), so the event loop keeps streaming other requests.
"""

from __future__ import annotations

from engine_client.text.chat import ChatMessage
from engine_client.text.detokenizer import TextStream
from engine_client.text.vocabulary import Vocabulary
from proto.decode.v1 import decode_pb2 as pb

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
# Text prompts longer than this are tokenized on a worker thread.
INLINE_TEXT_CHARS = 2048


class BadPrompt(ValueError):
    """The request's prompt cannot be used (INVALID_ARGUMENT)."""


def kind(request: pb.GenerateRequest) -> str | None:
    """ "token_ids", "text", "chat" or None (no prompt)."""
    return request.WhichOneof("prompt")


def is_long(request: pb.GenerateRequest) -> bool:
    """Whether tokenizing the prompt is worth a worker thread."""
    if kind(request) == "text":
        return len(request.text) > INLINE_TEXT_CHARS
    if kind(request) == "chat":
        return sum(len(m.content) for m in request.chat.messages) > INLINE_TEXT_CHARS
    return False


def tokenize(request: pb.GenerateRequest, vocab: Vocabulary) -> list[int]:
    """The prompt's token ids (not yet range-checked). BadPrompt if there is none."""
    which = kind(request)
    if which == "token_ids":
        ids = list(request.token_ids.ids)
    elif which == "text":
        ids = vocab.encode(request.text)
    elif which == "chat":
        try:
            msgs = [ChatMessage(m.role, m.content) for m in request.chat.messages]
            ids = vocab.encode_chat(msgs)
        except ValueError as e:
            raise BadPrompt(str(e)) from None
    else:
        raise BadPrompt("a prompt is needed: token_ids, text or chat")
    if not ids:
        raise BadPrompt(f"the {which} prompt holds no token")
    return ids


def check_stop(request: pb.GenerateRequest) -> None:
    stop = request.sampling.stop
    if len(stop) > MAX_STOP_STRINGS:
        raise BadPrompt(f"at most {MAX_STOP_STRINGS} stop strings")
    if any(not s or len(s) > MAX_STOP_CHARS for s in stop):
        raise BadPrompt(f"stop strings must hold 1..{MAX_STOP_CHARS} characters")


def text_stream(request: pb.GenerateRequest, vocab: Vocabulary) -> TextStream | None:
    """The detokenizer of a request with text output, else None (ids only)."""
    stop = tuple(request.sampling.stop)
    if kind(request) in ("text", "chat") or request.return_text or stop:
        return TextStream(vocab, stop)
    return None
