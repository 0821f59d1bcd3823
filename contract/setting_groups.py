"""A config made of setting groups (nested config dataclasses, as `contract.flags` reads them)
built or changed by its settings' names, flat, the way its flags name them: who writes
`compose(EngineConfig, kv_mode="embedded", overlap=False)` need not know which group owns which
setting. A group may also be given whole, by its field name. Each name has one owner (flags
refuses a setting declared twice), so the routing is unambiguous."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, TypeVar

T = TypeVar("T")


def _is_group(hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _take(cls: type[T], settings: dict[str, Any]) -> T:
    """`cls` from the settings it owns (popped from `settings`), its defaults for the rest: a
    group with a default is that default changed; one without is built from its settings."""
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        hint = hints[f.name]
        if f.name in settings:
            values[f.name] = settings.pop(f.name)
        elif _is_group(hint) and _default(f) is dataclasses.MISSING:
            values[f.name] = _take(hint, settings)
        elif _is_group(hint) and settings.keys() & _names(hint):
            values[f.name] = _replaced(_default(f), settings)
    return cls(**values)


def _replaced(config: T, changes: dict[str, Any]) -> T:
    hints = typing.get_type_hints(type(config))
    values = {}
    for f in dataclasses.fields(config):  # type: ignore[arg-type]
        if f.name in changes:
            values[f.name] = changes.pop(f.name)
        elif _is_group(hints[f.name]):
            values[f.name] = _replaced(getattr(config, f.name), changes)
    return dataclasses.replace(config, **values)  # type: ignore[type-var]


def _names(cls: type) -> set[str]:
    """Every field name of `cls` and of its groups, at any depth."""
    hints = typing.get_type_hints(cls)
    out = set()
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        out.add(f.name)
        if _is_group(hints[f.name]):
            out |= _names(hints[f.name])
    return out


def _known(cls: type, settings: dict[str, Any]) -> dict[str, Any]:
    unknown = set(settings) - _names(cls)
    if unknown:
        raise TypeError(f"{cls.__name__} has no setting {', '.join(sorted(unknown))}")
    return dict(settings)


def compose(cls: type[T], **settings: Any) -> T:
    """A `cls` with these settings, every group built from its own (the groups' defaults for
    the rest). Raises TypeError for a name no group owns, ValueError as the groups' checks do."""
    return _take(cls, _known(cls, settings))


def replace(config: T, **settings: Any) -> T:
    """`config` with these settings changed (dataclasses.replace through the groups); every
    group is checked again."""
    return _replaced(config, _known(type(config), settings))
