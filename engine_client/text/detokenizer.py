"""Incremental detokenization of a generated stream, with stop strings.

`TextStream.push(token)` returns the text that token releases:
- never a broken UTF-8 character: `tokenizers.decoders.DecodeStream` holds back tokens whose
  bytes end inside a character (DeepSeek's byte-level BPE splits many emoji and CJK characters
  across tokens), and releases the character once its last byte has arrived;
- never text that may still turn out to be part of a stop string: the longest suffix of the
  decoded text that is a prefix of some stop string is held, so a stop string that spans tokens
  is found whole. The stop string and anything after it are never released.
`finish()` releases what is held when the stream ends otherwise (length, cancel): the
concatenation of every release is then exactly `Vocabulary.decode(all tokens)`; bytes that
never complete a character come out as U+FFFD, as in that decode.

So a U+FFFD in released text is one of the tokens' own bytes that are not UTF-8 (a lone
continuation byte, a lead byte followed by ASCII), which the whole decode shows too: the
random-weight model emits such byte tokens often. Tokens that spell valid UTF-8, split anywhere,
never release one (tests/engine_client/text/test_text.py), as vLLM's and SGLang's incremental
detokenizers, which also hold text that ends in U+FFFD until the next token.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers.decoders import DecodeStream

from engine_client.text.vocabulary import Vocabulary


class TextStream:
    def __init__(
        self,
        vocab: Vocabulary,
        stop_strings: Sequence[str] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        if any(not s for s in stop_strings):
            raise ValueError("stop strings must not be empty")
        self.vocab, self.stop_strings = vocab, tuple(stop_strings)
        self.skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._ids: list[int] = []
        self._decoded = 0  # characters DecodeStream has given us so far
        self._held = ""  # decoded, not released: may be the start of a stop string
        self.text = ""  # everything released
        self.stopped = False  # a stop string was found: nothing more is released
        self._closed = False

    def push(self, token: int) -> str:
        """The text released by this token (maybe empty)."""
        if self.stopped or self._closed:
            return ""
        self._ids.append(token)
        piece = self._stream.step(self.vocab.tokenizer, token)
        if piece:
            self._decoded += len(piece)
            return self._release(self._held + piece)
        return ""

    def finish(self) -> str:
        """The end of the stream: release what is held (incomplete bytes as U+FFFD). Later
        calls (and pushes) release nothing."""
        if self.stopped or self._closed:
            return ""
        self._closed = True
        full = self.vocab.decode(self._ids, self.skip_special_tokens)
        # What DecodeStream still holds: full minus the characters it gave us.
        return self._release(self._held + full[self._decoded :], final=True)

    def _release(self, pending: str, final: bool = False) -> str:
        cut = self._first_stop(pending)
        if cut is not None:
            self.stopped = True
            out, self._held = pending[:cut], ""
        else:
            keep = 0 if final else self._stop_prefix_len(pending)
            out, self._held = pending[: len(pending) - keep], pending[len(pending) - keep :]
        self.text += out
        return out

    def _first_stop(self, pending: str) -> int | None:
        hits = [i for i in (pending.find(s) for s in self.stop_strings) if i >= 0]
        return min(hits) if hits else None

    def _stop_prefix_len(self, pending: str) -> int:
        """Length of the longest suffix of `pending` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop_strings:
            for n in range(min(len(s) - 1, len(pending)), best, -1):
                if pending.endswith(s[:n]):
                    best = n
                    break
        return best
