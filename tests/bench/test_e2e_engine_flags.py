"""bench.e2e's engine switches reach the engines they name, and the engine's own parser reads
them as its settings:
- --decode-part-tail reaches every mode's engine, the baseline included (the model splits its
  decode GEMMs alike in every mode, so the modes stay comparable), and so does --late-queries;
- --copy-priority and --copy-grid reach the engines with a miss-copy stream of their own
  (embedded, service);
- --host-reads reaches the HiSparse layouts (the embedded engine's, the service's), never the
  baseline's.
Without a flag no engine gets it."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from bench.e2e import plan, run_args
from bench.e2e.cli import parse_args, sizes_from_args
from contract import flags
from contract.layout import KVLayout
from engine_client.cli.main import add_serve, engine_config
from engine_client.kv.hisparse import OVERLAP_COPY_GRID, HiSparseBackend
from engine_client.model.compute import build_backend, side_copy_grid
from engine_client.serve.config import EngineConfig
from kernels.kit.kernel_set import KernelSet
from kernels.swap.copy_grid import CopyGrid
from kv_service.memory.store import allocate_local

LAYOUT = KVLayout(
    num_layers=1,
    max_requests=2,
    hot_slots=9,
    window=1,
    topk=4,
    page_size=4,
    num_pages=8,
    max_context=16,
)


def _engine(argv: list[str]) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_serve(parser.add_subparsers(dest="command"), {})
    return engine_config(parser.parse_args(["serve", *argv]), {})


def _argv(sizes: plan.Sizes, mode: str) -> list[str]:
    return run_args.engine_flags(sizes, plan.build_matrix(sizes, (mode,), ("trace",))[0])


def test_the_part_tail_reaches_every_mode() -> None:
    on = sizes_from_args(parse_args(["--smoke", "--decode-part-tail"]), "cpu")
    off = sizes_from_args(parse_args(["--smoke"]), "cpu")
    assert on.decode_part_tail and not off.decode_part_tail
    for mode in ("baseline", "embedded", "service"):
        assert _engine(_argv(on, mode)).batching.decode_part_tail is True, mode
        assert _engine(_argv(off, mode)).batching.decode_part_tail is False, mode
    assert flags.flag_name("decode_part_tail") == "--decode-part-tail"


def test_late_queries_reach_every_mode() -> None:
    """--late-queries: every mode's engine reads --decode-late-queries 1 (bits do not move, and
    every mode runs the same model code, so the baseline gets it too)."""
    on = sizes_from_args(parse_args(["--smoke", "--late-queries"]), "cpu")
    off = sizes_from_args(parse_args(["--smoke"]), "cpu")
    for mode in ("baseline", "embedded", "service"):
        assert _engine(_argv(on, mode)).batching.decode_late_queries is True, mode
        assert _engine(_argv(off, mode)).batching.decode_late_queries is False, mode
    assert flags.flag_name("decode_late_queries") == "--decode-late-queries"


def test_the_copy_priority_reaches_the_engines_that_copy() -> None:
    on = sizes_from_args(parse_args(["--smoke", "--copy-priority", "-1"]), "cpu")
    off = sizes_from_args(parse_args(["--smoke"]), "cpu")
    assert (on.copy_priority, off.copy_priority) == (-1, 0)
    for mode, expected in (("baseline", 0), ("embedded", -1), ("service", -1)):
        assert _engine(_argv(on, mode)).batching.decode_copy_priority == expected, mode
        assert _engine(_argv(off, mode)).batching.decode_copy_priority == 0, mode


def test_the_engines_copy_priority_reaches_its_backend() -> None:
    """--decode-copy-priority sets the priority of the backend's copy grid and nothing else of
    it (the grid's rule stays the measured default)."""
    backend = _backend(["--decode-copy-priority", "-1"])
    assert backend.copy_grid == dataclasses.replace(OVERLAP_COPY_GRID, priority=-1)


def _backend(argv: list[str]) -> HiSparseBackend:
    """The embedded engine's backend as assembly builds it from the engine's flags."""
    cfg = _engine(argv).batching
    backend = build_backend(
        "embedded",
        LAYOUT,
        allocate_local(LAYOUT, "cpu"),
        KernelSet.reference(),
        2,
        "cpu",
        None,
        None,
        microbatches=cfg.decode_microbatches,
        copy_grid=side_copy_grid(cfg.decode_copy_grid, cfg.decode_copy_priority),
    )
    assert isinstance(backend, HiSparseBackend)
    return backend


def test_the_copy_grid_reaches_the_engines_that_copy() -> None:
    on = sizes_from_args(parse_args(["--smoke", "--copy-grid", "8@64Kx32"]), "cpu")
    off = sizes_from_args(parse_args(["--smoke"]), "cpu")
    assert (on.copy_grid, off.copy_grid) == ("8@64Kx32", "")
    for mode, expected in (("baseline", ""), ("embedded", "8@64Kx32"), ("service", "8@64Kx32")):
        assert ("--decode-copy-grid" in _argv(on, mode)) == bool(expected), mode
        assert _engine(_argv(on, mode)).batching.decode_copy_grid == expected, mode
        assert "--decode-copy-grid" not in _argv(off, mode), mode
        assert _engine(_argv(off, mode)).batching.decode_copy_grid == "", mode


def test_a_bad_copy_grid_fails_before_any_engine(capsys) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--smoke", "--copy-grid", "8@3K"])
    assert "bad copy grid spec '8@3K'" in capsys.readouterr().err


def test_the_engine_checks_its_copy_grid() -> None:
    assert _engine(["--decode-copy-grid", "8@64Kx32"]).batching.decode_copy_grid == "8@64Kx32"
    assert _engine(["--decode-copy-grid", "default@16Kx8p"]).batching.decode_copy_grid
    for bad in ("8@3K", "x", "8@64Kx3", "0", "64/8"):
        with pytest.raises(ValueError, match=f"decode_copy_grid: bad copy grid spec '{bad}'"):
            _engine(["--decode-copy-grid", bad])


def test_the_engines_copy_grid_reaches_its_backend() -> None:
    """The spec is the whole launch; --decode-copy-priority still sets the stream's priority;
    `default` is the backend's own grid."""
    got = _backend(["--decode-copy-grid", "8@64Kx32", "--decode-copy-priority", "-1"])
    assert got.copy_grid == CopyGrid(8, chunk_bytes=64 << 10, warps=32, priority=-1)
    wide = _backend(["--decode-copy-grid", "default@16Kx8p"]).copy_grid
    assert wide == dataclasses.replace(OVERLAP_COPY_GRID, chunk_bytes=16384, warps=8, prefetch=True)
    assert _backend([]).copy_grid == OVERLAP_COPY_GRID


def test_host_reads_reach_the_hisparse_layouts_only() -> None:
    """--host-reads 1 with --hot-slots below W + k: the embedded engine's layout and the
    service's get host_reads; the baseline's stays host_reads-free and valid (its hot_slots
    raised to W + k: it keeps every row on the GPU)."""
    on = sizes_from_args(parse_args(["--smoke", "--hot-slots", "16", "--host-reads", "1"]), "cpu")
    assert on.host_reads and on.hot_slots < on.window + on.topk
    # The KV mode comes from engine_process (engine_client/serve/procs.py), not these flags.
    embedded = _engine([*_argv(on, "embedded"), "--kv-mode", "embedded"]).local
    assert embedded.host_reads and embedded.hot_slots == 16
    baseline = _engine([*_argv(on, "baseline"), "--kv-mode", "baseline"]).local
    assert not baseline.host_reads and baseline.hot_slots == on.window + on.topk
    run = plan.build_matrix(on, ("service",), ("trace",))[0]
    service = run_args.service_flags(on, run)
    assert service[service.index("--host-reads") + 1] == "1"
    assert "--host-reads" not in _argv(on, "service")  # the service's layout carries it
