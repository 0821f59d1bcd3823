"""The KV row format option: flags, env, presets, and an engine that refuses a service whose rows
are in another format (real processes)."""

from __future__ import annotations

import pytest

from engine_client.__main__ import main as engine_main
from engine_client.config import EngineConfig
from engine_client.factory import model_config
from engine_client.preset import ConfigError, preset
from engine_client.procs import ChildFailed, engine_process
from kv_service.__main__ import parse as parse_service
from tests.process_harness import layout_with, start_service, workdir


def test_presets_default_row_formats() -> None:
    assert preset("v32").row_format == "fp8"
    assert preset("tiny").row_format == "bf16" and preset("bench").row_format == "bf16"
    with pytest.raises(ConfigError, match="row_format"):
        preset("tiny", row_format="fp16")


def test_engine_row_format_overrides_the_preset() -> None:
    cfg = EngineConfig(uds="/tmp/x.sock", preset="v32", num_layers=2)
    assert model_config(cfg).row_format == "fp8"
    cfg = EngineConfig(uds="/tmp/x.sock", preset="v32", num_layers=2, row_format="bf16")
    assert model_config(cfg).row_format == "bf16"
    with pytest.raises(ValueError, match="row_format"):
        EngineConfig(uds="/tmp/x.sock", row_format="int4")


def test_flags_and_env(monkeypatch) -> None:
    seen = {}
    monkeypatch.setattr("engine_client.server.run", lambda cfg: seen.setdefault("cfg", cfg) and 0)
    assert engine_main(["serve", "--kv-mode", "baseline", "--uds", "/tmp/x.sock"],
                       env={"ENGINE_ROW_FORMAT": "fp8"}) == 0
    assert seen.pop("cfg").row_format == "fp8"
    assert engine_main(["serve", "--kv-mode", "baseline", "--uds", "/tmp/x.sock"], env={}) == 0
    assert seen.pop("cfg").row_format is None                 # the preset decides
    cfg, _ = parse_service(["--uds", "/tmp/k.sock"], {"KVS_ROW_FORMAT": "fp8"})
    assert cfg.layout.row_format == "fp8" and cfg.layout.row_bytes == 656
    cfg, _ = parse_service(["--uds", "/tmp/k.sock", "--row-format", "bf16"],
                           {"KVS_ROW_FORMAT": "fp8"})
    assert cfg.layout.row_format == "bf16"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_attach_refuses_a_row_format_mismatch() -> None:
    """An fp8 service and a bf16 engine: the engine exits at start with a clear error instead of
    reading 656 B rows as 1152 B ones."""
    with workdir() as path:
        svc = start_service(path, layout_with(row_format="fp8"))
        eng = engine_process(path, "service", service_uds=svc.uds,
                             extra=["--device", "cpu", "--row-format", "bf16"])
        try:
            with pytest.raises(ChildFailed):
                eng.start().wait_serving(60)
            assert eng.stop() != 0
            log = eng.log()
            assert "row format mismatch" in log and "--row-format" in log, log
        finally:
            eng.kill()
            assert svc.stop() == 0, svc.log()
