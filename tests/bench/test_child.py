"""bench.shared.child: the arguments and environment every benchmark gives its children, and the
engine flags e2e and prefix build from them (recorded in e2e's JSON, so their order is kept)."""

from __future__ import annotations

import os
from pathlib import Path

from bench.e2e import plan, run_args
from bench.e2e.cli import parse_args, sizes_from_args
from bench.prefix import plan as prefix_plan
from bench.shared.child import child_env, engine_argv, run_python, service_extra
from engine_client.serve.procs import REPO_ROOT

TAIL = ["--rpc-timeout", "60", "--attach-timeout", "120", "--log-level", "WARNING"]


def test_engine_arguments_put_the_run_between_the_model_and_the_timeouts() -> None:
    argv = engine_argv("tiny", 4, 16, ["--prefix-cache", "1"])
    head = ["--preset", "tiny", "--max-batch", "4", "--prefill-chunk", "16"]
    assert argv == [*head, "--prefix-cache", "1", *TAIL]
    assert service_extra("--drain-timeout", "5") == [
        "--lease-seconds", "10", "--drain-timeout", "5", "--log-level", "WARNING"
    ]  # fmt: skip


def test_e2e_engine_flags_keep_their_recorded_order() -> None:
    sizes = sizes_from_args(parse_args(["--smoke"]), "cpu")
    run = plan.build_matrix(sizes, ("baseline", "service"), ("trace",))[0]
    argv = run_args.engine_flags(sizes, run)
    assert run.mode == "baseline"
    source = ["--topk-source", "bench.shared.trace:trace_source"]
    assert argv[6:10] == ["--synthetic-context", str(run.context), *source]
    assert argv[10:16] == TAIL
    assert argv[16:18] == ["--device", "cpu"]  # the baseline holds its KV itself


def test_prefix_engine_flags_share_the_engine_arguments() -> None:
    sizes = prefix_plan.Sizes(
        preset="tiny", device="cpu", gpu_kv_bytes=1 << 21, context=256, shared=128,
        prompt_len=8, steady_steps=8, hot_slots=32, window=8, page_size=16, prefill_chunk=64,
        ttft_suffix=8, ttft_repeats=1, conversations=1, turns=1, message=8, answer=8,
    )  # fmt: skip
    lay = prefix_plan.layout(sizes, 4, 64, 256)
    service = prefix_plan.engine_flags(sizes, "service", lay, True, ["--x", "1"])
    cache = ["--prefix-cache", "1", "--prefix-reuse-pages", "1"]
    assert service == engine_argv("tiny", 4, 64, cache) + ["--x", "1"]
    baseline = prefix_plan.engine_flags(sizes, "baseline", lay, False, [])
    assert baseline[baseline.index("--device") + 1] == "cpu"


def test_children_import_this_checkout_from_anywhere() -> None:
    env = child_env()
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(REPO_ROOT)
    out = run_python("import sys, bench.shared.child as c; print(c.__file__)", [], timeout=60)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()).resolve() == REPO_ROOT / "bench" / "shared" / "child.py"
