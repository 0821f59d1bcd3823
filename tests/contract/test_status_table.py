"""kvcache.proto documents, per RPC, every status it returns and whether to retry; this reads
that table and checks it against what the service really sends (`transport.status.status_of`,
the one mapping the interceptor and the Session stream's in-band errors use):

- each documented (code, reason) is what an error of that reason maps to;
- "Retry: yes" exactly for the retryable codes, and those are the file header's list;
- every reason the service can send is documented for some RPC; every RPC has its table;
- StepEnd states its entry limit.
"""

from __future__ import annotations

import re
from pathlib import Path

import grpc
import pytest

from contract.errors import BY_REASON, CapacityError
from transport.status import RETRYABLE_CODES, status_of

PROTO = Path(__file__).resolve().parents[2] / "proto/kvcache/v1/kvcache.proto"
LINE_RE = re.compile(r"^(?P<code>[A-Z_]+) \((?P<reasons>[A-Z_, ]+)\): (?P<when>.*)$")
RETRY_RE = re.compile(r"Retry: (yes|no)\.$")
# Reasons only a client produces: its own deadline.
CLIENT_ONLY = {"DEADLINE_EXCEEDED"}


def _comment_blocks() -> dict[tuple[str, str], list[tuple[str, tuple[str, ...], bool]]]:
    """(rpc, block title) -> [(code, reasons, retry)] from the comments above each rpc."""
    tables: dict[tuple[str, str], list[tuple[str, tuple[str, ...], bool]]] = {}
    comments: list[str] = []
    for raw in PROTO.read_text().splitlines():
        line = raw.strip()
        if line.startswith("//"):
            comments.append(line[2:])
            continue
        m = re.match(r"rpc (\w+)\(", line)
        if m:
            tables.update(_parse(m[1], comments))
        comments = []
    return tables


def _parse(rpc: str, comments: list[str]):
    """Entries start at 2 spaces of indent, continue at 4; block titles end with ':'."""
    out: dict[tuple[str, str], list] = {}
    title, entry = None, ""
    for c in comments + ["END"]:
        if c.startswith("     ") and entry:
            entry += " " + c.strip()
            continue
        if entry:
            out[(rpc, title)].append(_entry(entry))
            entry = ""
        if c.startswith("   "):
            entry = c.strip()
        elif c.strip().endswith(":") or c.strip().startswith(("Statuses", "In-band")):
            title = c.strip().split(" (")[0].rstrip(":")
            out[(rpc, title)] = []
    return out


def _entry(text: str) -> tuple[str, tuple[str, ...], bool]:
    m, retry = LINE_RE.match(text), RETRY_RE.search(text)
    assert m and retry, f"not 'CODE (REASON, ...): when. Retry: yes|no.': {text!r}"
    return m["code"], tuple(r.strip() for r in m["reasons"].split(",")), retry[1] == "yes"


TABLES = _comment_blocks()


def test_every_rpc_has_its_table() -> None:
    assert sorted(TABLES) == [
        ("Attach", "Statuses"),
        ("Drain", "Statuses"),
        ("Flush", "Statuses"),
        ("GetStats", "Statuses"),
        ("RemoteSwap", "Statuses"),
        ("Session", "In-band Error codes"),
        ("Session", "Statuses"),
        ("TransferTarget", "Statuses"),
    ]
    assert all(TABLES.values())


@pytest.mark.parametrize("where", sorted(TABLES), ids=lambda w: f"{w[0]}-{w[1].split()[0]}")
def test_documented_statuses_are_what_the_service_maps(where) -> None:
    for code, reasons, retry in TABLES[where]:
        for reason in reasons:
            cls = BY_REASON[reason]
            exc = (
                CapacityError("x", permanent=code == "INVALID_ARGUMENT")
                if cls is CapacityError
                else cls("x")
            )
            status = status_of(exc)
            assert (status.code.name, status.reason) == (code, reason), (where, reason)
        assert retry == (grpc.StatusCode[code] in RETRYABLE_CODES), (where, code)


def test_retryable_codes_are_the_headers_list() -> None:
    m = re.search(r"// Retryable codes: ([A-Z_, ]+)\.", PROTO.read_text())
    assert m is not None
    assert {grpc.StatusCode[c.strip()] for c in m[1].split(",")} == set(RETRYABLE_CODES)


def test_every_reason_the_service_sends_is_documented() -> None:
    documented = {r for rows in TABLES.values() for _, reasons, _ in rows for r in reasons}
    assert documented == set(BY_REASON) - CLIENT_ONLY


def test_step_end_states_its_limits_and_no_stale_trailers() -> None:
    text = PROTO.read_text()
    start = text.index("message StepEnd {")
    # The message and the comment block above it (where the counters' bound is stated).
    step_end = text[text.rindex("\n\n", 0, start) : text.index("}", start)]
    assert "At most\n  // Layout.max_requests entries" in step_end
    assert "steps * num_layers * topk * max_requests" in step_end
    assert "kv-detail" not in text
