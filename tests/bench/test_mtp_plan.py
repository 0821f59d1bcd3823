"""bench.mtp's command without running it: the rates are checked as the engine checks them, each
D runs at the first D rates with the engine's explicit BENCHMARK-ONLY flag, every run of one
command shares the sizes of its largest D, and the summary states the rates and the tokens per
step they imply."""

from __future__ import annotations

import pytest

from bench.e2e.run_args import engine_flags
from bench.mtp.cli import parse_args, run_groups, sizes_of
from bench.mtp.report import summary


def test_rates_are_checked_as_the_engine_checks_them() -> None:
    for bad in ("1.2", "0.9,x", "0.9,0.8,0.7,0.6"):
        with pytest.raises(SystemExit):
            parse_args(["--speculative-acceptance", bad])
    for bad in ("0", "4", "1,x"):
        with pytest.raises(SystemExit):
            parse_args(["--draft-tokens", bad])
    with pytest.raises(SystemExit):  # more rates than the largest D
        parse_args(["--draft-tokens", "1", "--speculative-acceptance", "0.9,0.8"])


def test_each_d_runs_at_its_rates_beside_one_plain_run() -> None:
    args = parse_args(["--smoke", "--draft-tokens", "1,3", "--acceptance-seed", "5"])
    sizes = sizes_of(args, "cpu")
    # Sized for D = 3: B - W = k (D + 1), and room for D + 1 tokens per step.
    assert sizes.hot_slots - sizes.window == sizes.topk * 4 and sizes.tokens_per_step == 4
    groups = run_groups(sizes, args)
    assert [(p.mode, [s.draft_tokens for s in spec]) for p, spec in groups] == [
        ("baseline", [1, 3]),
        ("service", [1, 3]),
    ]
    plain, (one, three) = groups[1]
    assert not plain.draft_tokens and {one.slots, three.slots} == {plain.slots}
    assert one.acceptance == (0.9,) and three.acceptance == (0.9, 0.75, 0.6)
    argv = engine_flags(sizes, three)
    at = argv.index("--speculative-acceptance")
    assert argv[at : at + 6] == [
        "--speculative-acceptance",
        "0.9,0.75,0.6",
        "--speculative-acceptance-seed",
        "5",
        "--allow-benchmark-only",
        "1",
    ]
    assert "--speculative-acceptance" not in engine_flags(sizes, plain)
    # Speculative runs overlap steps as plain ones do, unless told not to.
    assert "--overlap" not in argv
    waiting = run_groups(sizes, parse_args(["--smoke", "--mtp-overlap", "0"]))[0][1][0]
    assert plain.overlap and not waiting.overlap
    flags = engine_flags(sizes, waiting)
    assert flags[flags.index("--overlap") + 1] == "0"


def test_the_summary_reports_tokens_and_misses_per_step() -> None:
    plain = {"max": {"window_tok_s": 100.0, "misses_per_step": 10.0}, "batch1": {}}
    spec = {
        "max": {
            "concurrency": 4,
            "window_tok_s": 150.0,
            "acceptance": 0.5,
            "misses_per_step": 12.0,
            "misses_rows_per_step": 18.0,
        },
        "batch1": {"itl_mean_s": 0.004},
    }
    group = {"plain": {"phases": plain}, "mtp": {"2": {"phases": spec}}}
    row = summary(group, 2, expected=2.1)
    assert row["tok_s_ratio"] == 1.5 and row["tokens_per_step"] == 2.0
    assert (row["misses_per_step_mtp"], row["misses_rows_per_step_mtp"]) == (12.0, 18.0)
    assert summary(group, 3, expected=2.5) == {}  # a D not run (budget)


def test_batch_invariant_both_ways_runs_every_group_twice() -> None:
    """--batch-invariant 0,1: each (context, mode) group with and without the engine's flag, so
    one command measures what batch invariance costs."""
    args = parse_args(["--smoke", "--draft-tokens", "1,3", "--batch-invariant", "0,1"])
    groups = run_groups(sizes_of(args, "cpu"), args)
    assert [(p.mode, p.batch_invariant) for p, _ in groups] == [
        ("baseline", False),
        ("baseline", True),
        ("service", False),
        ("service", True),
    ]
    for plain, spec in groups:
        for run in (plain, *spec):
            flags = engine_flags(sizes_of(args, "cpu"), run)
            assert ("--batch-invariant" in flags) == run.batch_invariant
            assert run.batch_invariant == plain.batch_invariant
    with pytest.raises(SystemExit):
        parse_args(["--batch-invariant", "2"])


def test_layers_reach_the_engines_and_the_service_and_keep_the_4_layer_n() -> None:
    """--layers L: the engines run L decoder layers (the service's layout holds L + 1 with the
    MTP layer's KV) and the default budget grows with L, so N is the 4-layer run's."""
    from bench.e2e import plan
    from bench.e2e.run_args import service_flags

    d1 = ["--draft-tokens", "1", "--speculative-acceptance", "0.9"]
    four = sizes_of(parse_args(d1), "cpu")
    sixteen = sizes_of(parse_args([*d1, "--layers", "16"]), "cpu")
    assert (four.num_layers, sixteen.num_layers) == (4, 16)
    assert sixteen.gpu_kv_bytes == pytest.approx(four.gpu_kv_bytes * 17 / 5, abs=1)
    for c in (32768, 131072):
        a, b = plan.plan_context(four, c), plan.plan_context(sixteen, c)
        assert abs(b.n_hisparse - a.n_hisparse) <= 1 and abs(b.n_baseline - a.n_baseline) <= 1
    plain, (mtp,) = run_groups(sixteen, parse_args([*d1, "--layers", "16"]))[1]
    argv = engine_flags(sixteen, mtp)
    assert argv[argv.index("--num-layers") + 1] == "16"
    svc = service_flags(sixteen, mtp)
    assert svc[svc.index("--num-layers") + 1] == "17"
    assert "--num-layers" not in engine_flags(four, run_groups(four, parse_args(d1))[0][0])
    with pytest.raises(SystemExit):
        parse_args(["--layers", "-1"])


def test_every_finished_run_is_saved_before_the_next_starts(monkeypatch) -> None:
    """A run cut by the device call's limit keeps the runs it finished (run_all's save)."""
    import asyncio
    import time

    from bench.mtp import cli

    args = parse_args(["--smoke", "--draft-tokens", "1", "--speculative-acceptance", "0.9"])
    groups = run_groups(sizes_of(args, "cpu"), args)
    done: list[str] = []

    async def measured(ctx, run, i):
        done.append(f"{run.mode}:{run.draft_tokens}")
        return {"run_s": 0.0, "phases": {}}

    saved: list[list[str]] = []

    def save(results):
        saved.append(
            [
                f"{g['mode']}:{d}"
                for g in results
                for d in (["0"] if "plain" in g else []) + list(g["mtp"])
            ]
        )
        assert len(saved[-1]) == len(done)  # saved right after each run, nothing lost or ahead

    monkeypatch.setattr(cli, "_measured", measured)
    ctx = {"t0": time.monotonic()}
    results = asyncio.run(cli.run_all(ctx, groups, None, save))
    assert done == ["baseline:0", "baseline:1", "service:0", "service:1"]
    assert saved[-1] == ["baseline:0", "baseline:1", "service:0", "service:1"]
    assert len(saved) == 4 and [g["mode"] for g in results] == ["baseline", "service"]
