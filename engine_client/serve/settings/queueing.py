"""How waiting requests are admitted (engine_client/loop/scheduler.py, queue_policy.py): the
order past a head refused for KV capacity, how many may run at once, how long one may wait, and
how often a refused admission is retried."""

from __future__ import annotations

from dataclasses import dataclass

from contract.flags import setting
from contract.rules import check_settings, one_of, seconds
from engine_client.loop.admission_setting import admission_setting
from engine_client.loop.queue_policy import QUEUE_POLICIES


@dataclass(frozen=True)
class Queueing:
    queue_policy: str = setting(
        "skip-ahead",
        choices=QUEUE_POLICIES,
        help="admission order once the queue's head is refused for KV capacity: fifo (nothing "
        "passes it) or skip-ahead (smaller requests pass it for --skip-ahead seconds)",
        check=one_of(QUEUE_POLICIES),
    )
    skip_ahead: float = setting(
        5.0,
        help="skip-ahead: seconds smaller requests may pass a queue head waiting for KV capacity",
        check=seconds(86400, zero=True),
    )
    admission_limit: str = setting(
        "auto",
        help="most requests running at once, below --max-batch: adaptive (admit while one more "
        "request raises the measured decode throughput; the miss copy of poor locality can make "
        "it fall), off (--max-batch), a number (fixed), or auto (adaptive in embedded/service "
        "modes, off in baseline)",
        check=admission_setting,
    )
    max_queue_wait: float = setting(
        300.0,
        help="seconds a request may wait for admission "
        "before it fails with RESOURCE_EXHAUSTED; 0: no limit",
        check=seconds(86400, zero=True),
    )
    admit_retry: float = setting(
        0.5,
        help="seconds between admission retries while the service has no capacity",
        check=seconds(3600, zero=False),
    )

    def __post_init__(self) -> None:
        check_settings(self)
