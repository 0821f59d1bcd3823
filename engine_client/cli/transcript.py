"""The demo's generations on screen as they stream: one line per generation, `[k] text`.

On a terminal the lines are redrawn in place, each showing the end of its text that fits the
width, and the whole texts once all have ended. Elsewhere (a pipe, a log, `--no-progress`) a
generation's new text is printed as a line of its own once it holds a line's worth, or the
generation ended, so the lines of concurrent generations interleave as they stream.

A character that would break the line layout is shown as one visible character: a newline as
⏎, another control character as ·. Text that is not UTF-8 (the random weights emit byte
tokens that form no character) arrives as U+FFFD from the engine and is shown as it is.
"""

from __future__ import annotations

import shutil
import sys
import unicodedata
from typing import TextIO

PLAIN_LINE = 48  # characters of new text per line when not redrawing in place
WIDE = ("W", "F")  # East Asian wide and full-width: two terminal columns


def visible(text: str) -> str:
    """`text` with one printable character for each character that is not printable."""
    return "".join(
        ch if ch.isprintable() else "⏎" if ch == "\n" else "·" if ch != " " else ch for ch in text
    )


def _columns(ch: str) -> int:
    return 2 if unicodedata.east_asian_width(ch) in WIDE else 1


def fit(text: str, columns: int) -> str:
    """The end of `text` that fits in `columns` terminal columns, "…" first if cut."""
    used, start = 0, len(text)
    while start > 0 and used + _columns(text[start - 1]) <= columns - 1:
        start -= 1
        used += _columns(text[start])
    return text if start == 0 else "…" + text[start:]


class Transcript:
    def __init__(self, n: int, live: bool, out: TextIO = sys.stdout) -> None:
        self.texts = [""] * n
        self.printed = [0] * n  # characters of each text already printed (plain lines)
        self.out = out
        self.live = live and out.isatty()
        if self.live:
            print("\n" * (n - 1), end="", file=out, flush=True)  # the lines redraws overwrite

    @staticmethod
    def label(i: int) -> str:
        return f"[{i + 1}]"

    def add(self, i: int, piece: str) -> None:
        """Generation i released `piece` of text."""
        self.texts[i] += visible(piece)
        if self.live:
            self._redraw(shutil.get_terminal_size().columns)
        elif len(self.texts[i]) - self.printed[i] >= PLAIN_LINE:
            self._print_new(i)

    def end(self, i: int) -> None:
        """Generation i ended: print what of it is not printed yet."""
        if not self.live:
            self._print_new(i)

    def close(self) -> None:
        """All ended: on a terminal, the whole texts (the terminal wraps the long ones)."""
        if self.live:
            self._redraw(None)

    def _print_new(self, i: int) -> None:
        new = self.texts[i][self.printed[i] :]
        if new:
            print(f"{self.label(i)} {new}", file=self.out, flush=True)
            self.printed[i] = len(self.texts[i])

    def _redraw(self, columns: int | None) -> None:
        """Every line again, from the first one up (columns None: not cut)."""
        up = len(self.texts) - 1
        lines = [f"\x1b[{up}F" if up else "\r"]
        for i, text in enumerate(self.texts):
            prefix = f"{self.label(i)} "
            shown = text if columns is None else fit(text, columns - len(prefix))
            lines.append(f"\x1b[2K{prefix}{shown}" + ("\n" if i < up else ""))
        print("".join(lines), end="" if columns is not None else "\n", file=self.out, flush=True)
