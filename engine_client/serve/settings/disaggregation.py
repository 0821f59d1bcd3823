"""Prefill/decode disaggregation: the engine's role and, for a decode engine, the prefill
engines it sends prompts to (their KV comes back over NIXL). Which KV mode each role needs is
a rule across groups, in `EngineConfig`."""

from __future__ import annotations

from dataclasses import dataclass

from contract.flags import setting
from contract.rules import check_settings, one_of, seconds
from contract.transfer_target import SOURCES

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
    transfer_source: str = setting(
        "auto",
        choices=SOURCES,
        help="--role prefill: what NIXL writes a prompt's KV from: auto (staged on a GPU, where "
        "run AE measured it 13x faster than direct; direct on CPU), direct (the cache itself: "
        "device memory on CUDA, straight into the decode side's host pages, a span per layer "
        "and page), staged (through a pinned host buffer, page-major: few spans; direct falls "
        "back to it where NIXL cannot register the device) or gathered (staged's page-major "
        "buffer in device memory: one request's pages of GPU memory more)",
        check=one_of(SOURCES),
    )
    transfer_peer_idle: float = setting(
        60.0,
        help="--role prefill: seconds a decode side's NIXL agent is kept loaded (its metadata "
        "and connection) after its last export; a side that died with nothing in flight is "
        "forgotten then, a live one is loaded again by its next prompt",
        check=seconds(86400, zero=False),
    )

    def __post_init__(self) -> None:
        check_settings(self)
