"""Each setting is declared once, as a config dataclass field: its flag, env variable, help and
default all come from there (contract.flags), and `to_flags` goes back from a config to flags."""

from __future__ import annotations

import argparse
import dataclasses
import typing

import pytest

from contract import flags, setting_groups
from contract.layout import KVLayout
from engine_client.cli.config import DemoConfig, GenerateConfig
from engine_client.cli.main import add_demo, add_generate, add_serve, engine_config
from engine_client.serve.config import EngineConfig
from engine_client.serve.settings.local_layout import LocalLayout
from kv_service.__main__ import build_parser
from kv_service.__main__ import parse_config as parse
from kv_service.config import DEFAULT_LAYOUT, ServiceConfig

CONFIGS = [
    (ServiceConfig, "KVS", 20),
    (EngineConfig, "ENGINE", 20),
    (GenerateConfig, "GENERATE", 8),
    (DemoConfig, "DEMO", 6),
]
SUBCOMMANDS = {
    EngineConfig: ("serve", add_serve),
    GenerateConfig: ("generate", add_generate),
    DemoConfig: ("demo", add_demo),
}


def _sub_parser(cls: type, env: dict[str, str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="engine")
    SUBCOMMANDS[cls][1](parser.add_subparsers(dest="command"), env)
    return parser


def _serve_parser(env: dict[str, str]) -> argparse.ArgumentParser:
    return _sub_parser(EngineConfig, env)


def _engine(argv: list[str], env: dict[str, str]) -> EngineConfig:
    return engine_config(_serve_parser(env).parse_args(["serve", *argv]), env)


def _client(cls: type, argv: list[str], env: dict[str, str]) -> object:
    """A `generate` or `demo` config from its flags, as __main__ builds it."""
    name = SUBCOMMANDS[cls][0]
    args = _sub_parser(cls, env).parse_args([name, *argv])
    return flags.build(cls, args, name.upper(), env)


def _leaf_fields(cls: type) -> list[dataclasses.Field]:
    """The settings of `cls`, those of its groups (the layout, the engine's setting groups)
    included."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out += _leaf_fields(hints[f.name])
        elif f.name != "version":  # the layout's wire version is no setting
            out.append(f)
    return out


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The parser's options by flag, those of its (one) subcommand included."""
    out = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out.update(_actions(sub))
        out.update({flag: action for flag in action.option_strings})
    return out


@pytest.mark.parametrize("cls,prefix,least", CONFIGS)
def test_every_field_has_a_flag_an_env_variable_and_help(
    cls: type, prefix: str, least: int
) -> None:
    actions = _actions(build_parser({}) if cls is ServiceConfig else _sub_parser(cls, {}))
    fields = _leaf_fields(cls)
    assert len(fields) >= least
    for f in fields:
        assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help"
        action = actions[flags.flag_name(flags.stem(f))]
        assert action.help.endswith(f"[env {prefix}_{flags.stem(f).upper()}]"), f.name
        assert action.dest == f.name


def test_flag_beats_env_beats_default() -> None:
    assert parse([], {})[0].lease_seconds == 30.0
    assert parse([], {"KVS_LEASE_SECONDS": "7"})[0].lease_seconds == 7.0
    assert parse(["--lease-seconds", "3"], {"KVS_LEASE_SECONDS": "7"})[0].lease_seconds == 3.0
    # Nested (layout) settings, bools and optionals follow the same rule.
    assert parse([], {})[0].layout == DEFAULT_LAYOUT
    assert parse(["--topk", "64"], {"KVS_TOPK": "32"})[0].layout.topk == 64
    assert parse([], {"KVS_WARMUP": "no"})[0].warmup is False
    assert parse([], {"KVS_METRICS_PORT": "9100"})[0].metrics_port == 9100
    assert parse(["--metrics-port", ""], {"KVS_METRICS_PORT": "9100"})[0].metrics_port is None
    env = {
        "ENGINE_MAX_BATCH": "3",
        "ENGINE_HOT_SLOTS": "40",
        "ENGINE_OVERLAP": "0",
        "ENGINE_TOKEN": "secret-env",
    }
    cfg = _engine(["--max-batch", "5"], env)
    assert (cfg.batching.max_batch, cfg.local.hot_slots, cfg.batching.overlap, cfg.kv.token) == (
        5,
        40,
        False,
        "secret-env",
    )
    assert _engine(["--token", "flag-token"], env).kv.token == "flag-token"
    default = _engine([], {})
    assert (default.kv.kv_mode, default.kv.attach_timeout, default.model.num_layers) == (
        "service",
        5.0,
        None,
    )
    assert default.endpoints.uds.endswith("hisparse-engine.sock")


def test_a_list_flag_takes_commas_and_repeats() -> None:
    """--prefill-peer a,b --prefill-peer c is three peers; a flag replaces the env's list."""
    decode = ["--role", "decode", "--kv-mode", "service", "--service", "/tmp/kv.sock"]
    env = {"ENGINE_PREFILL_PEER": "x:1, y:2"}
    assert _engine(decode, env).disaggregation.prefill_peer == ("x:1", "y:2")
    argv = [*decode, "--prefill-peer", "a,b:50051", "--prefill-peer", "unix:/c.sock"]
    assert _engine(argv, env).disaggregation.prefill_peer == ("a", "b:50051", "unix:/c.sock")
    with pytest.raises(ValueError, match="--prefill-peer"):
        _engine(decode, {})


def test_secrets_stay_out_of_help_and_flags() -> None:
    env = {"KVS_TOKEN": "sekrit-value"}
    assert "sekrit-value" not in build_parser(env).format_help()
    config = parse([], env)[0]
    assert config.token == "sekrit-value"
    assert "--token" not in flags.to_flags(config) and "sekrit-value" not in repr(config)


@pytest.mark.parametrize(
    "env,needle",
    [
        ({"KVS_NUM_LAYERS": "many"}, "KVS_NUM_LAYERS"),
        ({"KVS_WARMUP": "maybe"}, "KVS_WARMUP"),
        ({"KVS_SOCKET_MODE": "9"}, "KVS_SOCKET_MODE"),
        ({"KVS_LEASE_SECONDS": "-1"}, "lease_seconds"),
        ({"KVS_LOG_LEVEL": "chatty"}, "log_level"),
    ],
)
def test_bad_env_values_are_usage_errors(
    env: dict[str, str], needle: str, capsys: pytest.CaptureFixture
) -> None:
    with pytest.raises(SystemExit) as err:
        parse([], env)
    assert err.value.code == 2
    message = capsys.readouterr().err
    assert needle in message and "Traceback" not in message


def test_bad_engine_env_value_names_its_variable(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        _engine([], {"ENGINE_CUDA_GRAPHS": "perhaps"})
    assert "ENGINE_CUDA_GRAPHS" in capsys.readouterr().err


def test_a_flag_overrides_a_bad_env_value() -> None:
    assert parse(["--num-layers", "3"], {"KVS_NUM_LAYERS": "many"})[0].layout.num_layers == 3


@pytest.mark.parametrize(
    "config,prefix",
    [
        (
            ServiceConfig(
                layout=dataclasses.replace(DEFAULT_LAYOUT, num_layers=3, row_format="fp8"),
                uds="/tmp/x.sock",
                tcp="127.0.0.1:5",
                metrics_port=9,
                socket_mode=0o660,
                warmup=False,
                lease_seconds=2.5,
            ),
            "KVS",
        ),
        (
            setting_groups.compose(
                EngineConfig,
                uds="/tmp/e.sock",
                service="/tmp/s.sock",
                num_layers=4,
                overlap=False,
                local=LocalLayout(hot_slots=48, index_format="fp8"),
                skip_ahead=0.25,
            ),
            "ENGINE",
        ),
    ],
)
def test_to_flags_round_trips_a_config(config: object, prefix: str) -> None:
    argv = flags.to_flags(config)
    parsed = parse(argv, {})[0] if prefix == "KVS" else _engine(argv, {})
    assert parsed == config


def test_layout_flags_are_the_layout_fields() -> None:
    layout = KVLayout(
        num_layers=2,
        max_requests=4,
        hot_slots=16,
        window=4,
        topk=8,
        page_size=4,
        num_pages=32,
        max_context=64,
    )
    argv = flags.to_flags(layout)
    assert argv[:4] == ["--num-layers", "2", "--max-requests", "4"] and "--version" not in argv
    assert parse(argv, {})[0].layout == layout


def test_generate_flags_keep_their_names_and_env() -> None:
    cfg = _client(
        GenerateConfig,
        ["--ids", "5,6,7", "--stop", "2,9", "--resume", "r1", "--target", "/tmp/e.sock"],
        {},
    )
    assert (cfg.prompt, cfg.stop_token_ids, cfg.resume_request_id) == ((5, 6, 7), (2, 9), "r1")
    assert cfg.target == "unix:/tmp/e.sock" and cfg.connect_timeout == 5.0
    default = _client(GenerateConfig, [], {})
    assert (default.prompt, default.stop_token_ids, default.max_new_tokens) == (
        (1, 2, 3, 4),
        (),
        16,
    )
    assert default.target.endswith("hisparse-engine.sock")
    env = {"ENGINE_TARGET": "h:1", "GENERATE_STOP": "3", "GENERATE_CONNECT_TIMEOUT": "0.5"}
    cfg = _client(GenerateConfig, [], env)
    assert (cfg.target, cfg.stop_token_ids, cfg.connect_timeout) == ("h:1", (3,), 0.5)
    # GENERATE_TARGET beats ENGINE_TARGET; a flag beats both.
    assert _client(GenerateConfig, [], {**env, "GENERATE_TARGET": "g:2"}).target == "g:2"
    assert (
        _client(GenerateConfig, ["--target", "f:3"], {**env, "GENERATE_TARGET": "g:2"}).target
        == "f:3"
    )


def test_generate_refuses_a_bad_connect_timeout() -> None:
    with pytest.raises(ValueError, match="connect_timeout"):
        _client(GenerateConfig, ["--connect-timeout", "0"], {})


def test_demo_reads_demo_variables_only() -> None:
    compose = {"ENGINE_KV_MODE": "baseline", "ENGINE_DEVICE": "cuda", "ENGINE_MAX_NEW_TOKENS": "9"}
    assert _client(DemoConfig, [], compose) == DemoConfig()
    cfg = _client(DemoConfig, [], {"DEMO_KV_MODE": "embedded", "DEMO_NO_PROGRESS": "1"})
    assert (cfg.kv_mode, cfg.progress) == ("embedded", False)
    assert _client(DemoConfig, ["--no-progress"], {}).progress is False
    assert _client(DemoConfig, [], {"DEMO_NO_PROGRESS": "no"}).progress is True


def test_bad_demo_env_value_names_its_variable(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        _client(DemoConfig, [], {"DEMO_NO_PROGRESS": "perhaps"})
    assert "DEMO_NO_PROGRESS" in capsys.readouterr().err
    # argparse checks no choices on defaults: the config's validation refuses it (a usage error
    # in __main__).
    with pytest.raises(ValueError, match="nowhere"):
        _client(DemoConfig, [], {"DEMO_KV_MODE": "nowhere"})


@pytest.mark.parametrize(
    "config",
    [
        GenerateConfig(
            target="unix:/tmp/e.sock",
            prompt=(7, 8),
            stop_token_ids=(1, 2),
            seed=3,
            resume_request_id="abc",
            temperature=0.5,
            connect_timeout=1.5,
        ),
        DemoConfig(kv_mode="embedded", requests=2, device="cpu", progress=False),
        DemoConfig(progress=True),
    ],
)
def test_to_flags_round_trips_client_configs(config: object) -> None:
    argv = flags.to_flags(config)
    assert ("--no-progress" in argv) == (getattr(config, "progress", True) is False)
    assert _client(type(config), argv, {}) == config
