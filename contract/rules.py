"""The rules a setting's value must obey, declared beside the setting (`setting(check=...)`)
so a config dataclass reads as its settings with their rules. A rule is a callable
`(name, value) -> None` that raises ValueError naming the setting; `check_settings` runs every
field's rule. Unset optional settings (None) are not checked: None means "off"."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Collection
from typing import Any

Rule = Callable[[str, Any], None]


def one_of(choices: Collection[Any]) -> Rule:
    def rule(name: str, value: Any) -> None:
        if value not in choices:
            raise ValueError(f"{name} must be one of {choices}, got {value!r}")

    return rule


def within(low: float, high: float) -> Rule:
    """An inclusive integer range, low..high."""

    def rule(name: str, value: Any) -> None:
        if not low <= value <= high:
            raise ValueError(f"{name} must be in {low}..{high}, got {value}")

    return rule


def seconds(high: float, zero: bool) -> Rule:
    """A duration up to `high` seconds; `zero` allows 0 (it then means "no limit" or "off")."""
    interval = f"[0, {high}]" if zero else f"(0, {high}]"

    def rule(name: str, value: Any) -> None:
        if not (0 <= value if zero else 0 < value) or value > high:
            raise ValueError(f"{name} must be in {interval} seconds, got {value}")

    return rule


def at_least(low: int) -> Rule:
    def rule(name: str, value: Any) -> None:
        if value < low:
            raise ValueError(f"{name} must be >= {low}, got {value}")

    return rule


def positive(name: str, value: Any) -> None:
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")


def non_empty(name: str, value: Any) -> None:
    if not value:
        raise ValueError(f"{name} must not be empty")


def text(max_bytes: int, empty: bool = True, spaces: bool = True) -> Rule:
    """Printable text of at most `max_bytes` bytes (UTF-8)."""
    what = (
        ("non-empty " if not empty else "")
        + "printable text"
        + ("" if spaces else " without spaces")
    )

    def rule(name: str, value: Any) -> None:
        bad = not value.isprintable() or len(value.encode()) > max_bytes
        if bad or (not empty and not value) or (not spaces and " " in value):
            raise ValueError(f"{name} must be {what} of at most {max_bytes} bytes")

    return rule


def length(low: int, high: int) -> Rule:
    def rule(name: str, value: Any) -> None:
        if not low <= len(value) <= high:
            raise ValueError(f"{name} must be {low}..{high} characters")

    return rule


def host_port(name: str, value: Any) -> None:
    if not HOST_PORT.fullmatch(value):
        raise ValueError(f"{name} must be HOST:PORT, got {value!r}")


def plugin_or(builtin: str) -> Rule:
    """The built-in source's name, or a MODULE:FUNC[:JSON] factory."""

    def rule(name: str, value: Any) -> None:
        if value != builtin and ":" not in value:
            raise ValueError(f"{name} must be {builtin!r} or MODULE:FUNC, got {value!r}")

    return rule


HOST_PORT = re.compile(r"(\[[0-9a-fA-F:]+\]|[\w.-]*):\d{1,5}")


def check_settings(instance: Any) -> None:
    """Run the rule declared on each field of the dataclass `instance` (in field order)."""
    for field in dataclasses.fields(instance):
        rule = field.metadata.get("check")
        value = getattr(instance, field.name)
        if rule is not None and value is not None:
            rule(field.name, value)
