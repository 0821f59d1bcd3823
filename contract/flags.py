"""Command-line flags and environment variables derived from a frozen config dataclass, so that
each setting is declared once: as a field with its default and its `help`.

A field declared with `setting(...)` becomes the flag `--field-name` whose default is the
environment variable PREFIX_FIELD_NAME (else the field's default), parsed by the field's type:
int, float, str, bool (1/0, true/false, yes/no), `tuple[int, ...]`, `tuple[float, ...]` or
`tuple[str, ...]` (comma-separated; a repeated flag adds to the list) or `X | None` (an empty
value is None). `flag=` names the flag and variable
when the field's name is not the command line's word (`stop_token_ids` is `--stop`);
`negated=True` makes a bool a switch without a value that turns it off (`progress` is
`--no-progress`, env PREFIX_NO_PROGRESS=1). A field whose type is itself a config dataclass
contributes its own settings, flat, with the same prefix.
`to_flags` goes the other way: the flags that reproduce a config, for whoever launches a process.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from typing import Any

_BOOL = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


def setting(
    default: Any = dataclasses.MISSING,
    *,
    help: str,  # noqa: A002 - argparse's word
    choices: tuple | None = None,
    parse: Callable[[str], Any] | None = None,
    show: Callable[[Any], str] | None = None,
    cli_default: Callable[[Mapping[str, str]], str] | None = None,
    secret: bool = False,
    flag: str | None = None,
    negated: bool = False,
    default_factory: Any = dataclasses.MISSING,
    check: Callable[[str, Any], None] | None = None,
) -> Any:
    """A dataclass field that is also a flag. `parse`/`show` override the text form of the
    type; `cli_default(env)` gives a default that depends on the environment (a socket path
    under $XDG_RUNTIME_DIR); a `secret` never shows in --help, repr or `to_flags`; `check` is
    the value's rule (contract.rules), run by `check_settings`."""
    meta = {
        "help": help,
        "choices": choices,
        "parse": parse,
        "show": show,
        "cli_default": cli_default,
        "secret": secret,
        "flag": flag,
        "negated": negated,
        "check": check,
    }
    return dataclasses.field(
        default=default, default_factory=default_factory, repr=not secret, metadata=meta
    )


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line (cause and value, then where the flags
    are listed) with exit status 2, instead of the whole usage text."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: {message} (--help lists every flag)\n")


class _EnvText(str):
    """A default taken from the environment, so a bad value names its variable."""

    env_name = ""


def env_name(prefix: str, name: str) -> str:
    return f"{prefix}_{name.upper()}"


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def stem(f: dataclasses.Field) -> str:
    """The word of a setting's flag and environment variable: its `flag`, else its name."""
    return f.metadata.get("flag") or f.name


class _Extend(argparse.Action):
    """A list flag given more than once: the first replaces the default, each next one adds
    (`--peer a --peer b` is `--peer a,b`)."""

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, *_: Any) -> None:
        seen = f"_given_{self.dest}"
        before = getattr(namespace, self.dest) if getattr(namespace, seen, False) else ()
        setattr(namespace, seen, True)
        setattr(namespace, self.dest, tuple(before) + tuple(values))


class _Switch(argparse.Action):
    """A flag without a value that turns its bool setting off (`--no-progress`)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, False)


def _parse_ids(text: str) -> tuple[int, ...]:
    return tuple(int(t) for t in text.replace(",", " ").split())


def _parse_floats(text: str) -> tuple[float, ...]:
    return tuple(float(t) for t in text.replace(",", " ").split())


def _parse_words(text: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in text.split(",") if t.strip())


def _parse_bool(text: str) -> bool:
    if text.lower() not in _BOOL:
        raise ValueError(f"expected 1/0, true/false or yes/no, got {text!r}")
    return _BOOL[text.lower()]


def _base_parser(hint: Any) -> tuple[Callable[[str], Any], bool]:
    """The text parser of a type hint, and whether None (empty text) is allowed."""
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (inner,) = [a for a in args if a is not type(None)]
        return _base_parser(inner)[0], True
    if hint is bool:
        return _parse_bool, False
    if hint == tuple[int, ...]:
        return _parse_ids, False
    if hint == tuple[float, ...]:
        return _parse_floats, False
    if hint == tuple[str, ...]:
        return _parse_words, False
    if hint in (int, float, str):
        return hint, False
    raise TypeError(f"no flag type for {hint!r}")


def _show(f: dataclasses.Field, value: Any) -> str:
    if f.metadata.get("show") is not None and value is not None:
        return f.metadata["show"](value)
    if value is None:
        return ""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    return repr(value) if isinstance(value, float) else str(value)


def _is_config(hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def _settings(cls: type, default_obj: Any = None) -> Iterator[tuple[dataclasses.Field, Any, Any]]:
    """(field, type hint, default or MISSING) of every setting of `cls`, nested ones flat."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if default_obj is not None:
            default = getattr(default_obj, f.name)
        elif f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = dataclasses.MISSING
        if _is_config(hints[f.name]):
            yield from _settings(hints[f.name], None if default is dataclasses.MISSING else default)
        elif "help" in f.metadata:
            yield f, hints[f.name], default


def _type_func(f: dataclasses.Field, hint: Any) -> Callable[[str], Any]:
    base, optional = _base_parser(hint)
    parse = f.metadata.get("parse") or base
    if f.metadata.get("negated"):
        # The switch's text (its env variable) says whether the setting is off.
        parse = lambda text: not _parse_bool(text)  # noqa: E731

    def convert(text: str) -> Any:
        if optional and text == "":
            return None
        try:
            return parse(text)
        except (TypeError, ValueError) as exc:
            where = f" (from env {text.env_name})" if isinstance(text, _EnvText) else ""
            raise argparse.ArgumentTypeError(f"invalid value {str(text)!r}{where}: {exc}") from None

    convert.__name__ = f.name
    return convert


def _flag_kind(f: dataclasses.Field, hint: Any) -> dict[str, Any]:
    """argparse's words for a setting: a switch, a list that a repeated flag extends, or a
    value (with its choices)."""
    if f.metadata["negated"]:
        return {"action": _Switch}
    kind: dict[str, Any] = {
        "choices": f.metadata["choices"],
        "metavar": None if f.metadata["choices"] else stem(f).upper(),
    }
    if hint == tuple[str, ...]:
        kind["action"] = _Extend
    return kind


def add_arguments(
    parser: argparse.ArgumentParser, cls: type, prefix: str, env: Mapping[str, str]
) -> None:
    """One flag per setting of `cls`; each flag's default is its environment variable, else
    the field's default."""
    seen: set[str] = set()
    for f, hint, default in _settings(cls):
        if stem(f) in seen:
            raise TypeError(f"{cls.__name__}: setting {stem(f)} is declared twice")
        seen.add(stem(f))
        name = env_name(prefix, stem(f))
        text: str | None
        if f.metadata["secret"]:
            # Resolved in `build`, so the environment's secret never shows in --help.
            text = None
        elif name in env:
            text = _EnvText(env[name])
            text.env_name = name
        elif f.metadata["cli_default"] is not None:
            text = f.metadata["cli_default"](env)
        elif f.metadata["negated"]:
            text = None if default is dataclasses.MISSING else _show(f, not default)
        else:
            text = None if default is dataclasses.MISSING else _show(f, default)
        parser.add_argument(
            flag_name(stem(f)),
            dest=f.name,
            type=_type_func(f, hint),
            default=text,
            help=f"{f.metadata['help']} [env {name}]",
            **_flag_kind(f, hint),
        )


def build(cls: type, args: argparse.Namespace, prefix: str, env: Mapping[str, str]) -> Any:
    """The config from parsed flags (secrets from the environment unless given as flags).
    Raises ValueError where the config's own validation refuses a value."""
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        if _is_config(hints[f.name]):
            values[f.name] = build(hints[f.name], args, prefix, env)
        elif "help" in f.metadata:
            value = getattr(args, f.name)
            name = env_name(prefix, stem(f))
            if f.metadata["secret"] and value is None and env.get(name):
                value = _type_func(f, hints[f.name])(env[name])
            values[f.name] = value
    return cls(**values)


def to_flags(config: Any) -> list[str]:
    """The command-line flags that give a process this config (secrets left out: pass them
    through the environment, where `ps` cannot read them)."""
    flags: list[str] = []
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if _is_config(hints[f.name]):
            flags += to_flags(value)
        elif "help" in f.metadata and f.metadata["negated"]:
            flags += [] if value else [flag_name(stem(f))]
        elif "help" in f.metadata and not f.metadata["secret"]:
            flags += [flag_name(stem(f)), _show(f, value)]
    return flags
