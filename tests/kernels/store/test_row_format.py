"""The KV row format option: a layout setting (the service's, or the engine's local layout),
never the model's; flags, env, and the benchmark's sizing of both formats. That service modes
adopt the service's format: tests/engine_client/model/test_layout_adoption.py."""

from __future__ import annotations

import dataclasses

import pytest

from contract.setting_groups import compose
from engine_client.cli.main import main as engine_main
from engine_client.model.preset import preset
from engine_client.serve.config import EngineConfig
from kernels.formats import FP8_ROW
from kv_service.__main__ import parse_config as parse_service


def test_the_row_format_is_the_layouts_not_the_models() -> None:
    assert not hasattr(preset("v32"), "row_format")
    cfg = compose(EngineConfig, kv_mode="baseline", uds="/tmp/x.sock", preset="v32", num_layers=2)
    assert cfg.local.row_format == "bf16"
    local = dataclasses.replace(cfg.local, row_format="fp8")
    assert local.layout(num_layers=2, topk=16).row is FP8_ROW
    with pytest.raises(ValueError, match="row_format"):
        dataclasses.replace(cfg.local, row_format="int4")


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
    assert seen.pop("cfg").local.row_format == "fp8"
    assert engine_main(["serve", "--kv-mode", "baseline", "--uds", "/tmp/x.sock"], env={}) == 0
    assert seen.pop("cfg").local.row_format == "bf16"
    cfg, _ = parse_service(["--uds", "/tmp/k.sock"], {"KVS_ROW_FORMAT": "fp8"})
    assert cfg.layout.row is FP8_ROW and cfg.layout.row_bytes == FP8_ROW.row_bytes
    cfg, _ = parse_service(
        ["--uds", "/tmp/k.sock", "--row-format", "bf16"], {"KVS_ROW_FORMAT": "fp8"}
    )
    assert cfg.layout.row_format == "bf16"


def test_e2e_sizes_both_formats_in_the_same_budget() -> None:
    """fp8 rows (656 B) fit more requests in the same GPU KV budget, in every mode, and the
    engine is started with the run's row format so it matches the service."""
    from dataclasses import replace

    from bench.e2e import plan, run_args
    from bench.e2e.cli import parse_args, sizes_from_args
    from bench.e2e.row_formats import summary

    bf16 = replace(sizes_from_args(parse_args([]), "cuda"), row_format="bf16")
    fp8 = replace(bf16, row_format="fp8")
    a, b = plan.plan_context(bf16, 32768), plan.plan_context(fp8, 32768)
    assert b.n_baseline > a.n_baseline and b.n_hisparse > a.n_hisparse
    run = plan.build_matrix(fp8, ("baseline", "service"), ("trace",))[0]
    flags = run_args.engine_flags(fp8, run)
    assert flags[flags.index("--row-format") + 1] == "fp8"
    svc = run_args.service_flags(fp8, run)
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
