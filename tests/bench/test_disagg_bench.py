"""bench.disagg's --smoke run on CPU (real processes: a colocated engine, then a prefill and a
decode engine over NIXL UCX): both runs give the same greedy tokens, and the bytes the prefill
engine wrote per prompt are exactly the prompt's KV rows and index-key pages. Its topology
parsing without processes. The run is skipped without the nixl package."""

from __future__ import annotations

import json

import pytest

from bench.disagg import cli, load, options, stack
from contract.nixl_agent import nixl_available


def test_topologies_parse() -> None:
    assert options.topologies("1x1, 2X2") == [(1, 1), (2, 2)]


def test_prefill_gpus_parse_and_are_checked_against_the_machine() -> None:
    assert options.prefill_gpus("") == ()
    assert options.prefill_gpus("1, 2") == (1, 2)
    assert options.prefill_gpus("1", count=2) == (1,)
    with pytest.raises(SystemExit, match="has 1 GPU"):
        options.prefill_gpus("1", count=1)


def test_a_prefill_gpu_index_maps_through_this_process_visible_devices(monkeypatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert stack.visible_gpu(1) == "1"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4, 6")
    assert stack.visible_gpu(1) == "6"


def test_speculative_runs_add_the_mtp_layer_and_the_verify_rows_room() -> None:
    plain = cli.parse_args(["--smoke"])
    spec = cli.parse_args(["--smoke", "--draft-tokens", "2", "--speculative-acceptance", "0.8"])
    assert options.speculation(plain) == ()
    flags = options.speculation(spec)
    assert flags[flags.index("--draft-tokens") + 1] == "2" and "--allow-benchmark-only" in flags
    a, b = options.layout(plain), options.layout(spec)
    assert b.num_layers == a.num_layers + 1
    assert b.hot_slots - b.window >= b.topk * 3  # the union of D + 1 rows' top-k
    assert b.max_context > a.max_context  # the rows a verify step may write past the last token
    b.check_draft_tokens(2)


def test_max_n_share_ends_with_the_first_background_stream_to_finish() -> None:
    bg = [{"arrivals": [0.5, 1.0, 4.0]}, {"arrivals": [0.5, 2.0]}, {"arrivals": []}]
    assert load.max_n_share(bg, start=1.0, end=5.0) == 0.25  # the second ends at 2.0
    assert load.max_n_share(bg[:1], start=1.0, end=3.0) == 1.0  # decoding past the window
    assert load.max_n_share(bg, start=3.0, end=5.0) == 0.0  # one ended before it began
    assert load.max_n_share([], start=1.0, end=5.0) == 0.0


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(not nixl_available(), reason="the nixl package is not installed")
def test_the_smoke_run_moves_the_prompts_kv_rows_and_matches_the_colocated_tokens(
    tmp_path,
) -> None:
    out = tmp_path / "disagg.json"
    assert cli.main(["--smoke", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    args = cli.parse_args(["--smoke"])
    colocated, disagg = result["runs"]
    assert (colocated["name"], disagg["name"]) == ("colocated", "1x1-auto")
    arrived = args.arrivals * args.arrival_tokens
    for run in (colocated, disagg):
        # The arrivals generate all theirs; the background at least its first token each, and
        # at most --tokens (it stops where the arrivals' window ends).
        assert arrived + args.streams <= run["tokens"] <= arrived + args.streams * args.tokens
        assert run["arrivals"] == args.arrivals
    assert result["compare"]["1x1-auto"]["same_tokens"]
    lay = options.layout(args)
    pages = -(-args.prompt // lay.page_size)
    rows = lay.num_layers * args.prompt * lay.row_bytes
    keys = lay.num_layers * pages * lay.page_size * lay.index_bytes
    moved = disagg["transfer"]
    assert moved["exports"] == args.streams + args.arrivals and moved["dropped"] == 0
    assert moved["bytes_per_prompt"] == rows + keys
    assert moved["memory_type"] == "DRAM" and result["pinned_copy_gb_per_s"] > 0
    # Each region's part of a write, posted to done: never longer than the whole write.
    parts = moved["region_ms_mean"]
    assert sorted(parts) == ["index", "rows"], parts
    assert all(0 < ms <= moved["write_ms_mean"] for ms in parts.values())
