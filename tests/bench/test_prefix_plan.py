"""bench.prefix's plan and summaries: the capacity part's top-k sources are bench.e2e's, the
TTFT part's resident case fits the hot buffer and caches whole prefill chunks, the engines get
--admission-limit when asked, a multi-turn turn's TTFT p50 comes with its parts, and a run cut
mid-part has saved every run it finished."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from bench.e2e import plan as e2e_plan
from bench.e2e import run_args
from bench.prefix import plan, runs
from bench.prefix.cli import parse_args, run_parts, sizes_from_args


def test_capacity_sources_are_those_of_e2e() -> None:
    sizes = e2e_plan.Sizes(
        preset="tiny", contexts=(128,), gpu_kv_bytes=1 << 20, hot_slots=32, window=8,
        page_size=8, prompt_len=8, steady_steps=8, batch1_tokens=1, device="cpu",
        sweep_requests=1,
    )  # fmt: skip
    for source in ("trace", "indexer"):
        run = next(r for r in e2e_plan.build_matrix(sizes, ("service",), (source,)))
        e2e = run_args.engine_flags(sizes, run)
        flags = plan.topk_flags(source)
        assert e2e[e2e.index("--topk-source") : e2e.index("--topk-source") + 2] == flags
    with pytest.raises(ValueError, match="top-k source"):
        plan.topk_flags("oracle")


@pytest.mark.parametrize("smoke", [True, False])
def test_the_resident_ttft_case_fits_the_hot_buffer_in_whole_chunks(smoke: bool) -> None:
    s = sizes_from_args(parse_args(["--smoke"] if smoke else []), "cpu")
    cases = plan.ttft_cases(s)
    assert cases["offloaded"] + s.ttft_suffix + 4 > s.hot_slots
    resident = cases["resident"]
    assert resident % s.prefill_chunk == 0 and 0 < resident + s.ttft_suffix + 4 <= s.hot_slots
    assert s.sources == ("trace", "indexer") and s.admission_limit == "auto"


def test_the_admission_limit_reaches_the_engines() -> None:
    s = sizes_from_args(parse_args(["--smoke", "--admission-limit", "off"]), "cpu")
    lay = plan.layout(s, 4, 64, 128)
    argv = plan.engine_flags(s, "service", lay, True, [])
    assert argv[argv.index("--admission-limit") + 1] == "off"
    auto = dataclasses.replace(s, admission_limit="auto")
    assert "--admission-limit" not in plan.engine_flags(auto, "service", lay, True, [])


def test_page_reuse_reaches_the_sharing_engines_only() -> None:
    s = sizes_from_args(parse_args(["--smoke"]), "cpu")
    lay = plan.layout(s, 4, 64, 128)
    argv = plan.engine_flags(s, "service", lay, True, [])
    assert argv[argv.index("--prefix-reuse-pages") + 1] == "1"
    assert "--prefix-reuse-pages" not in plan.engine_flags(s, "service", lay, False, [])
    off = sizes_from_args(parse_args(["--smoke", "--reuse-pages", "0"]), "cpu")
    argv = plan.engine_flags(off, "service", lay, True, [])
    assert argv[argv.index("--prefix-reuse-pages") + 1] == "0"


def test_a_turns_ttft_comes_with_its_parts() -> None:
    turns = [
        {"prompt": 40, "cached": 32, "ttft_s": 1.0, "queued_s": 0.6, "prefill_wait_s": 0.3},
        {"prompt": 40, "cached": 32, "ttft_s": 0.5, "queued_s": 0.1, "prefill_wait_s": 0.3},
        {"prompt": 40, "cached": 0, "ttft_s": 0.2, "queued_s": 0.0, "prefill_wait_s": 0.1},
    ]
    got = runs.turn_summary(turns)
    assert got["prefilled_mean"] == pytest.approx(56 / 3)
    assert (got["ttft_p50_s"], got["queued_p50_s"], got["prefill_wait_p50_s"]) == (0.5, 0.1, 0.3)
    assert got["rest_p50_s"] == pytest.approx(0.1)


def test_the_shared_slots_run_fits_more_requests_in_the_same_budget() -> None:
    # The GPU defaults (bench preset, 32K contexts, 24K shared, 6 GiB), sized without a GPU.
    s = sizes_from_args(parse_args([]), "cpu")
    plain, shared, region, _ = plan.capacity_runs(s)
    assert (region.shared_slots, region.hot_slots) == (12 * 2176, 128 + 2048)
    assert plain.slots < shared.slots < region.slots
    lay = plan.capacity_layout(s, region)
    assert lay.max_requests == region.slots + 12 and lay.shared_slots == region.shared_slots
    assert "--shared-slots" in plan.service_flags(s, lay)
    argv = plan.engine_flags(s, "service", lay, True, [])
    assert argv[argv.index("--max-batch") + 1] == str(region.slots)  # not the region's slots
    none = sizes_from_args(parse_args(["--shared-slots", "0"]), "cpu")
    assert [r.shared_slots for r in plan.capacity_runs(none)] == [0, 0, 0]
    only = sizes_from_args(parse_args(["--capacity-runs", "sharing,slots"]), "cpu")
    assert [r.label for r in plan.capacity_runs(only)] == [shared.label, region.label]
    with pytest.raises(ValueError, match="capacity runs"):
        plan.capacity_runs(dataclasses.replace(only, capacity_runs=("everything",)))


def test_a_run_cut_mid_part_has_saved_every_run_it_finished(monkeypatch) -> None:
    """run X1 (H100) lost a whole capacity table to its stage's time limit: the JSON was written
    only at the end. Now each finished run is saved before the next starts."""
    saved: list[dict] = []

    async def capacity(p, s, load, vocab, out):
        out.append({"run": "plain"})
        out.append({"run": "sharing"})
        raise TimeoutError("the stage's limit")  # the third run never ends

    async def ttft(p, s, vocab, out):
        raise AssertionError("not reached")

    monkeypatch.setattr(runs, "capacity", capacity)
    monkeypatch.setattr(runs, "ttft", ttft)
    args = parse_args(["--smoke", "--parts", "capacity,ttft"])
    s = sizes_from_args(args, "cpu")
    save = lambda results: saved.append({k: list(v) for k, v in results.items()})  # noqa: E731
    with pytest.raises(TimeoutError):
        asyncio.run(run_parts(args, s, None, save))
    assert saved[-1] == {"capacity": [{"run": "plain"}, {"run": "sharing"}]}
    assert len(saved) == 2
