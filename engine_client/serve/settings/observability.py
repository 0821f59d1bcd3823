"""How the engine is observed: its Prometheus /metrics endpoint and its log level."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from contract.flags import setting
from contract.rules import check_settings, non_empty, one_of, within

LOG_LEVELS = tuple(logging.getLevelNamesMapping())


@dataclass(frozen=True)
class Observability:
    metrics_port: int | None = setting(
        None, help="serve Prometheus /metrics on this port; empty: off", check=within(0, 65535)
    )
    metrics_address: str = setting(
        "127.0.0.1", help="address of the /metrics endpoint", check=non_empty
    )
    log_level: str = setting(
        "INFO", help="logging level", parse=str.upper, check=one_of(LOG_LEVELS)
    )

    def __post_init__(self) -> None:
        check_settings(self)
