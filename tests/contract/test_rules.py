"""Rules declared beside each setting (contract.rules): each names the setting it refuses,
an unset optional setting is not checked, and EngineConfig's groups run the rules of their
fields plus the ones that tie their settings together, EngineConfig those across groups."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from contract.flags import setting
from contract.rules import check_settings, one_of, seconds, within
from contract.setting_groups import compose
from engine_client.serve.config import EngineConfig
from engine_client.serve.settings.local_layout import LocalLayout


@dataclass(frozen=True)
class Knobs:
    mode: str = setting("a", help="mode", check=one_of(("a", "b")))
    count: int | None = setting(None, help="count", check=within(1, 4))
    wait: float = setting(1.0, help="wait", check=seconds(10, zero=False))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "c"}, r"mode must be one of \('a', 'b'\), got 'c'"),
        ({"count": 5}, r"count must be in 1\.\.4, got 5"),
        ({"wait": 0.0}, r"wait must be in \(0, 10\] seconds, got 0.0"),
    ],
)
def test_a_rule_refuses_a_bad_value_naming_the_setting(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        check_settings(Knobs(**kwargs))


def test_an_unset_optional_setting_is_not_checked() -> None:
    check_settings(Knobs(count=None))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_batch": 0}, "max_batch must be in 1..4096"),
        ({"token": "a b"}, "token must be non-empty printable text without spaces"),
        ({"kv_mode": "service"}, "needs the service address"),
        ({"synthetic_context": 2, "synthetic_shared": 3}, "synthetic_shared must be in"),
        ({"uds": ""}, "needs a uds path or a tcp address"),
        ({"uds": "/" + "x" * 200}, "longer than 107 bytes"),
        # Rules across groups: the role's and the shared slots' KV mode.
        ({"role": "prefill"}, "--role prefill computes prompts in its own cache"),
        (
            {"kv_mode": "baseline", "local": LocalLayout(shared_slots=64)},
            "sizes embedded mode's own memory",
        ),
        (
            {"kv_mode": "baseline", "local": LocalLayout(host_reads=True)},
            "--host-reads sizes embedded mode's own memory",
        ),
    ],
)
def test_engine_config_refuses(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        compose(EngineConfig, **{"uds": "/tmp/e.sock", "kv_mode": "embedded", **kwargs})


def test_engine_config_accepts_its_defaults() -> None:
    assert compose(EngineConfig, uds="/tmp/e.sock", kv_mode="embedded").batching.max_batch == 8
