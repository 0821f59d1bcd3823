"""The engine's --admission-limit setting: its words, its check, and the AdmissionLimit it
names (engine_client.loop.admission_limit)."""

from __future__ import annotations

from engine_client.loop.admission_limit import AdmissionLimit

# --admission-limit's words; a number is a fixed limit.
ADMISSION_MODES = ("auto", "adaptive", "off")


def admission_setting(name: str, value: str) -> None:
    """The rule of the engine's --admission-limit: one of ADMISSION_MODES or a number >= 1."""
    if value not in ADMISSION_MODES and not (value.isdigit() and int(value) >= 1):
        raise ValueError(f"{name} must be one of {ADMISSION_MODES} or a number >= 1, got {value!r}")


def admission_limit(
    value: str, capacity: int, hisparse: bool, padded: tuple[int, ...] = ()
) -> AdmissionLimit:
    """The limit --admission-limit `value` names, under `capacity` (--max-batch); auto is
    adaptive where requests' KV lives off the GPU (`hisparse`), where the miss copy can make one
    more request cost more than it brings, and off in the baseline. `padded`: as the class's."""
    admission_setting("admission_limit", value)
    if value == "adaptive" or (value == "auto" and hisparse):
        return AdmissionLimit(capacity, padded=padded)
    if value.isdigit():
        return AdmissionLimit.fixed(min(int(value), capacity))
    return AdmissionLimit.fixed(capacity)
