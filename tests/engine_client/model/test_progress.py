"""Progress of long engine operations: log lines without a terminal, a tqdm bar on one."""

from __future__ import annotations

import io
import logging
import sys

import pytest

from engine_client.model.progress import Progress


def test_log_lines_without_a_terminal(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="engine_client.progress")
    with Progress("synthetic context", 8, "chunk") as p:
        for _ in range(8):
            p.update()
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "synthetic context: 8 chunks"
    assert lines[1:4] == [f"synthetic context: {n}/8 chunks" for n in (2, 4, 6)]
    assert lines[4].startswith("synthetic context: done in ") and len(lines) == 5


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_bar_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    with Progress("graph capture", 4, "batch bucket") as p:
        for _ in range(4):
            p.update()
    assert "graph capture" in term.getvalue() and "/4 [" in term.getvalue()
