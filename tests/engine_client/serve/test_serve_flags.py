"""`python -m engine_client serve`'s flags are a public surface (compose files, docs/DEPLOY.md,
bench/ and tests launch engines with them): every flag's name, env variable, help, default,
choices and kind, and the config its defaults build, are pinned in serve_flags.json. The
snapshot was written before the engine's config was split into setting groups (issue 39), so
the split provably kept them; the order in --help follows the groups and is not pinned.

A deliberate change of a flag: rewrite the snapshot with
`python -c "from tests.engine_client.serve.test_serve_flags import write; write()"` (from the
repository root) and review its diff."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from engine_client.cli.main import add_serve, engine_config

SNAPSHOT = Path(__file__).with_name("serve_flags.json")
ENV: dict[str, str] = {}  # no XDG_RUNTIME_DIR: the default sockets sit in /tmp


def _serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="engine")
    add_serve(parser.add_subparsers(dest="command"), ENV)
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def _json(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _options(parser: argparse.ArgumentParser) -> dict[str, dict[str, Any]]:
    """Each flag of `serve` as --help and parsing see it."""
    return {
        flag: {
            "dest": a.dest,
            "help": a.help,
            "default": _json(a.default),
            "choices": _json(a.choices),
            "metavar": a.metavar,
            "kind": type(a).__name__,
            "nargs": a.nargs,
        }
        for a in parser._actions
        for flag in a.option_strings
    }


def _settings(config: Any) -> dict[str, Any]:
    """Every setting of a config by name, nested configs' flat (as the flags name them)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            out.update(_settings(value))
        else:
            out[f.name] = _json(value)
    return out


def describe() -> dict[str, Any]:
    parser = _serve_parser()
    config = engine_config(parser.parse_args([]), ENV)
    return {"flags": _options(parser), "defaults": _settings(config)}


def test_serve_flags_match_the_snapshot() -> None:
    pinned = json.loads(SNAPSHOT.read_text())
    now = json.loads(json.dumps(describe()))
    assert sorted(now["flags"]) == sorted(pinned["flags"]), "flags added or removed"
    for flag, option in pinned["flags"].items():
        assert now["flags"][flag] == option, flag
    assert now["defaults"] == pinned["defaults"]


def test_the_snapshot_sees_every_setting() -> None:
    """A real check: the flags cover all the config's settings and the help has each env."""
    now = describe()
    dests = {o["dest"] for o in now["flags"].values()} - {"help"}
    assert dests == set(now["defaults"]) and len(dests) >= 50
    for flag, option in now["flags"].items():
        if option["dest"] != "help":
            env = "ENGINE_" + flag.removeprefix("--").replace("-", "_").upper()
            assert option["help"].endswith(f"[env {env}]"), flag


def write() -> None:
    SNAPSHOT.write_text(json.dumps(describe(), indent=1, sort_keys=True) + "\n")
