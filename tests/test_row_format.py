"""The KV row format option: flags, env, presets, and an engine that refuses a service whose rows
are in another format (real processes)."""

from __future__ import annotations

import pytest

from engine_client.cli.main import main as engine_main
from engine_client.model.preset import ConfigError, preset
from engine_client.serve.config import EngineConfig
from engine_client.serve.factory import model_config
from engine_client.serve.procs import ChildFailed, engine_process
from kv_service.__main__ import parse as parse_service
from tests.process_harness import layout_with, start_service, workdir


def test_presets_default_row_formats() -> None:
    assert preset("v32").row_format == "fp8"
    assert preset("tiny").row_format == "bf16" and preset("bench").row_format == "bf16"
    with pytest.raises(ConfigError, match="row_format"):
        preset("tiny", row_format="fp16")


def test_engine_row_format_overrides_the_preset() -> None:
    cfg = EngineConfig(kv_mode="baseline", uds="/tmp/x.sock", preset="v32", num_layers=2)
    assert model_config(cfg).row_format == "fp8"
    cfg = EngineConfig(
        kv_mode="baseline", uds="/tmp/x.sock", preset="v32", num_layers=2, row_format="bf16"
    )
    assert model_config(cfg).row_format == "bf16"
    with pytest.raises(ValueError, match="row_format"):
        EngineConfig(kv_mode="baseline", uds="/tmp/x.sock", row_format="int4")


def test_flags_and_env(monkeypatch) -> None:
    seen = {}
    monkeypatch.setattr(
        "engine_client.serve.server.run", lambda cfg: seen.setdefault("cfg", cfg) and 0
    )
    assert (
        engine_main(
            ["serve", "--kv-mode", "baseline", "--uds", "/tmp/x.sock"],
            env={"ENGINE_ROW_FORMAT": "fp8"},
        )
        == 0
    )
    assert seen.pop("cfg").row_format == "fp8"
    assert engine_main(["serve", "--kv-mode", "baseline", "--uds", "/tmp/x.sock"], env={}) == 0
    assert seen.pop("cfg").row_format is None  # the preset decides
    cfg, _ = parse_service(["--uds", "/tmp/k.sock"], {"KVS_ROW_FORMAT": "fp8"})
    assert cfg.layout.row_format == "fp8" and cfg.layout.row_bytes == 656
    cfg, _ = parse_service(
        ["--uds", "/tmp/k.sock", "--row-format", "bf16"], {"KVS_ROW_FORMAT": "fp8"}
    )
    assert cfg.layout.row_format == "bf16"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_attach_refuses_a_row_format_mismatch() -> None:
    """An fp8 service and a bf16 engine: the engine exits at start with a clear error instead of
    reading 656 B rows as 1152 B ones."""
    with workdir() as path:
        svc = start_service(path, layout_with(row_format="fp8"))
        eng = engine_process(
            path, "service", service_uds=svc.uds, extra=["--device", "cpu", "--row-format", "bf16"]
        )
        try:
            with pytest.raises(ChildFailed):
                eng.start().wait_serving(60)
            assert eng.stop() != 0
            log = eng.log()
            assert "row format mismatch" in log and "--row-format" in log, log
        finally:
            eng.kill()
            assert svc.stop() == 0, svc.log()


def test_e2e_sizes_both_formats_in_the_same_budget() -> None:
    """fp8 rows (656 B) fit more requests in the same GPU KV budget, in every mode, and the
    engine is started with the run's row format so it matches the service."""
    from dataclasses import replace

    from bench import e2e_plan as plan
    from bench.e2e import parse_args, sizes_from_args
    from bench.row_formats import summary

    bf16 = replace(sizes_from_args(parse_args([]), "cuda"), row_format="bf16")
    fp8 = replace(bf16, row_format="fp8")
    a, b = plan.plan_context(bf16, 32768), plan.plan_context(fp8, 32768)
    assert b.n_baseline > a.n_baseline and b.n_hisparse > a.n_hisparse
    run = plan.build_matrix(fp8, ("baseline", "service"), ("trace",))[0]
    flags = plan.engine_flags(fp8, run)
    assert flags[flags.index("--row-format") + 1] == "fp8"
    svc = plan.service_flags(fp8, run)
    assert svc[svc.index("--row-format") + 1] == "fp8"
    payload = {
        "sizes": {"row_format": "fp8"},
        "attention_probe": {str(b.n_hisparse): 1.5},
        "plans": {"32768": b.to_dict(fp8)},
        "runs": [
            {
                "context": 32768,
                "mode": m,
                "source": "trace",
                "tag": "main",
                "phases": {"max": {"tok_s": t, "h2d_gbs": 3.0}},
            }
            for m, t in (("baseline", 100.0), ("service", 250.0))
        ],
    }
    [line] = summary(payload)
    assert line["max_req_baseline"] == b.n_baseline and line["max_req_hisparse"] == b.n_hisparse
    assert (line["tok_s_baseline"], line["tok_s_service"]) == (100.0, 250.0)
    assert line["miss_gbs_service"] == 3.0 and line["attn_us_per_req_layer"] == 1.5
