"""bench.e2e --decode-part-tail reaches every mode's engine, the baseline included (the model
splits its decode GEMMs alike in every mode, so the modes stay comparable), and the engine's own
parser reads it as the setting; without the flag no engine gets it."""

from __future__ import annotations

import argparse

from bench.e2e import plan, run_args
from bench.e2e.cli import parse_args, sizes_from_args
from contract import flags
from engine_client.cli.main import add_serve, engine_config


def _engine_setting(argv: list[str]) -> bool:
    parser = argparse.ArgumentParser()
    add_serve(parser.add_subparsers(dest="command"), {})
    return engine_config(parser.parse_args(["serve", *argv]), {}).batching.decode_part_tail


def test_the_part_tail_reaches_every_mode() -> None:
    on = sizes_from_args(parse_args(["--smoke", "--decode-part-tail"]), "cpu")
    off = sizes_from_args(parse_args(["--smoke"]), "cpu")
    assert on.decode_part_tail and not off.decode_part_tail
    for mode in ("baseline", "embedded", "service"):
        run = plan.build_matrix(on, (mode,), ("trace",))[0]
        assert _engine_setting(run_args.engine_flags(on, run)) is True, mode
        assert _engine_setting(run_args.engine_flags(off, run)) is False, mode
    assert flags.flag_name("decode_part_tail") == "--decode-part-tail"
