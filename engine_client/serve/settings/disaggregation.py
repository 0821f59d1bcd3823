"""Prefill/decode disaggregation: the engine's role and, for a decode engine, the prefill
engines it sends prompts to (their KV comes back over NIXL). Which KV mode each role needs is
a rule across groups, in `EngineConfig`."""

from __future__ import annotations

from dataclasses import dataclass

from contract.flags import setting
from contract.rules import check_settings, one_of

ROLES = ("both", "prefill", "decode")


@dataclass(frozen=True)
class Disaggregation:
    role: str = setting(
        "both",
        choices=ROLES,
        help="prefill/decode disaggregation over NIXL: both (prefill and decode here), prefill "
        "(computes prompts and writes their KV into a decode side's pages; baseline mode) or "
        "decode (admits, has --prefill-peer prefill, then decodes; service mode)",
        check=one_of(ROLES),
    )
    prefill_peer: tuple[str, ...] = setting(
        (),
        help="--role decode: the prefill engines' addresses (socket path, unix:PATH, HOST:PORT), "
        "comma-separated or the flag repeated; taken round-robin, skipping a peer down or full",
    )

    def __post_init__(self) -> None:
        check_settings(self)
