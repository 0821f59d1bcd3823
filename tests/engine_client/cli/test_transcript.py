"""The demo's transcript: every generation's text on lines of its own, printed as it streams (a
pipe), or redrawn in place without ever wrapping (a terminal), ending with the whole texts."""

from __future__ import annotations

import io
import re

from engine_client.cli.transcript import PLAIN_LINE, Transcript, fit, visible


class Terminal(io.StringIO):
    """A StringIO that says it is a terminal, and the screen its output draws (the escapes the
    transcript uses: cursor up to column 0, erase line)."""

    def isatty(self) -> bool:
        return True

    def screen(self) -> list[str]:
        lines, row, data = [""], 0, self.getvalue()
        for token in re.findall(r"\x1b\[\d*[FK]|.", data, re.S):
            if token.endswith("F"):
                row -= int(token[2:-1] or 1)
            elif token.endswith("K") or token == "\r":
                lines[row] = "" if token.endswith("K") else lines[row]
            elif token == "\n":
                row += 1
                lines += [""] * (row + 1 - len(lines))
            else:
                lines[row] += token
        return lines


TEXTS = ["héllo wörld, " * 6, "你好世界" * 15 + "\nend", "🙂 ok"]


def _feed(t: Transcript) -> None:
    """The texts a few characters at a time, the generations taking turns."""
    for start in range(0, max(map(len, TEXTS)), 5):
        for i, text in enumerate(TEXTS):
            if text[start : start + 5]:
                t.add(i, text[start : start + 5])
    for i in range(len(TEXTS)):
        t.end(i)
    t.close()


def test_on_a_pipe_lines_interleave_and_hold_every_character() -> None:
    out = io.StringIO()
    _feed(Transcript(len(TEXTS), live=True, out=out))  # not a terminal: plain lines
    lines = out.getvalue().splitlines()
    # A line once a generation has PLAIN_LINE new characters, the rest when it ends.
    assert [line[:3] for line in lines] == ["[1]", "[2]", "[1]", "[2]", "[3]"]
    for i, text in enumerate(TEXTS):
        mine = [line[4:] for line in lines if line.startswith(f"[{i + 1}] ")]
        assert "".join(mine) == visible(text) and all(len(m) <= PLAIN_LINE + 4 for m in mine)


def test_on_a_terminal_lines_are_redrawn_in_place_then_shown_whole() -> None:
    term = Terminal()
    _feed(Transcript(len(TEXTS), live=True, out=term))
    screen = term.screen()
    assert screen[: len(TEXTS)] == [f"[{i + 1}] {visible(t)}" for i, t in enumerate(TEXTS)]
    assert "⏎" in screen[1]  # the newline did not break the layout


def test_fit_counts_wide_characters_twice() -> None:
    assert fit("abc", 10) == "abc"
    assert fit("你好世界", 6) == "…世界"  # 1 + 2 + 2 columns
    assert visible("a\nb\tc\x00") == "a⏎b·c·"
