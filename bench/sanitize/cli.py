"""Every Triton kernel family of the engine, launched under compute-sanitizer in one short run, and
the sanitizer's findings counted per family (bench/sanitize.sh).

`python -m bench.sanitize` builds an embedded engine (tiny preset, Triton kernels, no CUDA
graphs: each launch comes from Python) whose `KernelSet` entries are wrapped: after each call the
device is synchronized and a marker line names the entry, so what the sanitizer prints before a
marker (on the same stdout) belongs to that launch. It decodes requests of irregular lengths,
some longer than the hot buffer (misses: miss copy), in each row format, then checks that every
entry ran. `--layers 1` runs a one-layer model: each layer launches the same kernels on the same
shapes (only the base addresses differ), so for racecheck and synccheck, whose findings depend on
a kernel's code path and shape, the second layer is repetition at the tools' slowest; memcheck
keeps the preset's layers (an index past the last layer's rows shows only there).
`python -m bench.sanitize --table LOG` reads such a run's output and prints,
per entry, the launches and the sanitizer's error lines before its markers. `--modes LOG` reads
the churn test's run under the sanitizer (pytest -s -rA) the same way: per KV mode, the
sanitizer's error lines after the mode's marker (the test prints MODE_MARKER as a mode starts;
the service process the mode starts reports there too), the mode's test outcome, and where its
seconds went (the test's TIME_MARKER line: service start, engine build with its graph capture,
churn steps).

On CPU it runs the same path in Triton's interpreter (a smoke test; no sanitizer there).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import re
import sys
from collections import Counter

MARKER = "@@sanitize-kernel "
MODE_MARKER = "@@sanitize-mode "  # printed by tests/integration/test_engine_stress.py
# "@@sanitize-time embedded service 0.0 engine 9.1 churn 20.3 steps 18 (stop 2 length 1
# cancelled 7)", after the mode's churn: the requests that ended each way out (the churn's
# coverage) in the "ends" column as stop/length/cancelled.
TIME_MARKER = re.compile(
    r"^@@sanitize-time (?P<mode>[a-z-]+) service (?P<service>[\d.]+) engine (?P<engine>[\d.]+) "
    r"churn (?P<churn>[\d.]+) steps (?P<steps>\d+)"
    r"(?: \(stop (?P<stop>\d+) length (?P<length>\d+) cancelled (?P<cancelled>\d+)\))?"
)
TIME_COLUMNS = ("steps", "service", "engine", "churn", "ends")
SECONDS = ("service", "engine", "churn")
# pytest -rA's line of one mode: "PASSED tests/...::test_churn_under_overlap_on_gpu[service]"
OUTCOME = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED)\b.*\[(?P<mode>[a-z-]+)\]")
# Requests of irregular lengths: inside and past the hot buffer (32 slots), odd page remainders.
# A few tokens each: under racecheck every launch is slow.
PROMPTS = ((1, 2), (13, 3), (45, 3))
# (kv mode, row format, batch-invariant): the embedded engine runs every entry but kv_quantize,
# which only the all-on-GPU baseline runs (for a row format with a quantize function), and the
# dense ones (linear, bmm, rms_norm, layer_norm), which only --batch-invariant runs: without
# that run they were never launched and the kernel pass failed (H100, 2026-12-05).
RUNS = (
    ("embedded", "bf16", False),
    ("embedded", "fp8", False),
    ("baseline", "fp8", False),
    ("embedded", "fp8", True),
)
LAUNCHES: Counter[str] = Counter()
# Sanitizer lines that are not findings.
INFO = re.compile(
    r"^========= (COMPUTE-SANITIZER|ERROR SUMMARY|RACECHECK SUMMARY|Target application|"
    r"This application|Disabling|Note:|\s)"
)


def _marked(name: str, fn, device: str):
    import torch

    def call(*args, **kwargs):
        out = fn(*args, **kwargs)
        if device == "cuda":
            torch.cuda.synchronize()  # the launch has ended: its findings are printed before
        LAUNCHES[name] += 1
        print(f"{MARKER}{name}", flush=True)
        return out

    return call


def _patch_kernel_set(device: str) -> None:
    """Make KernelSet.triton() hand out marked entries."""
    from kernels.kit.kernel_set import KernelSet

    plain = KernelSet.triton

    def marked(cls) -> KernelSet:
        ks = plain()
        marks = {n: _marked(n, getattr(ks, n), device) for n in _entry_names()}
        return dataclasses.replace(ks, **marks)

    KernelSet.triton = classmethod(marked)  # type: ignore[method-assign,assignment]


def _config(kv_mode: str, row_format: str, invariant: bool, device: str, layers: int | None):
    """A small embedded/baseline engine's config: Triton kernels launched from Python."""
    from contract import setting_groups
    from engine_client.serve.config import EngineConfig
    from engine_client.serve.settings.local_layout import LocalLayout

    local = LocalLayout(
        max_requests=4,
        hot_slots=32,
        window=8,
        page_size=8,
        num_pages=48,
        max_context=128,
        row_format=row_format,
    )
    return setting_groups.compose(
        EngineConfig,
        kv_mode=kv_mode,
        uds="/tmp/unused.sock",
        device=device,
        local=local,
        max_batch=4,
        prefill_chunk=8,
        kernels="triton",
        cuda_graphs=False,
        num_layers=layers,
        batch_invariant=invariant,
    )


async def _decode(
    kv_mode: str, row_format: str, invariant: bool, device: str, layers: int | None
) -> None:
    from engine_client.loop.request import SamplingParams
    from engine_client.serve.factory import build_engine

    engine = await build_engine(_config(kv_mode, row_format, invariant, device, layers))
    engine.start()
    try:
        reqs = [
            engine.api.submit(tuple(range(3, 3 + n)), new, SamplingParams()) for n, new in PROMPTS
        ]
        async with asyncio.timeout(600):
            while not all(r.finished for r in reqs):
                await asyncio.sleep(0.01)  # the engine's loop runs meanwhile
    finally:
        await engine.stop()


def run(device: str, layers: int | None = None) -> int:
    """layers: the model's (None: the preset's)."""
    _patch_kernel_set(device)
    for kv_mode, fmt, invariant in RUNS:
        asyncio.run(_decode(kv_mode, fmt, invariant, device, layers))
    print(f"{MARKER}(end)", flush=True)
    missing = [n for n in _entry_names() if LAUNCHES[n] == 0]
    print(f"launches: {dict(sorted(LAUNCHES.items()))}", flush=True)
    if missing:
        print(f"never launched: {', '.join(missing)}")
    return 1 if missing else 0


def table(log_path: str) -> int:
    """Per entry: launches and the sanitizer's findings printed before its markers."""
    launches: Counter[str] = Counter()
    findings: Counter[str] = Counter()
    pending = 0
    with open(log_path, errors="replace") as f:
        for line in f:
            if line.startswith(MARKER):
                name = line[len(MARKER) :].strip()
                launches[name] += 1
                findings[name] += pending
                pending = 0
            elif line.startswith("========= ") and not INFO.match(line):
                pending += 1
    findings["(after the last launch)"] += pending
    launches.pop("(end)", None)
    findings["(after the last launch)"] += findings.pop("(end)", 0)
    print(f"{'kernel':<24} {'launches':>9} {'findings':>9}")
    for name in sorted(launches) + ["(after the last launch)"]:
        print(f"{name:<24} {launches[name]:>9} {findings[name]:>9}")
    missing = [n for n in _entry_names() if launches[n] == 0]
    if missing:
        print(f"never launched: {', '.join(missing)}")
    return 1 if missing or sum(findings.values()) else 0


def modes(log_path: str) -> int:
    """Per KV mode of the churn: the sanitizer's findings after its marker, its outcome, its
    steps and seconds."""
    findings: Counter[str] = Counter()
    outcome: dict[str, str] = {}
    times: dict[str, dict[str, str]] = {}
    mode = "(before the first mode)"
    with open(log_path, errors="replace") as f:
        for line in f:
            if line.startswith(MODE_MARKER):
                mode = line[len(MODE_MARKER) :].strip()
                findings[mode] += 0
            elif line.startswith("========= ") and not INFO.match(line):
                findings[mode] += 1
            elif m := OUTCOME.match(line):
                outcome[m["mode"]] = m[1]
            elif m := TIME_MARKER.match(line):
                times[m["mode"]] = {c: m[c] for c in TIME_COLUMNS[:-1]}
                if m["stop"] is not None:
                    times[m["mode"]]["ends"] = f"{m['stop']}/{m['length']}/{m['cancelled']}"
    heads = " ".join(f"{c + (' s' if c in SECONDS else ''):>10}" for c in TIME_COLUMNS)
    print(f"{'KV mode':<24} {'findings':>9} {'outcome':>9} {heads}")
    for name in sorted(set(findings) | set(outcome)):
        spent = " ".join(f"{times.get(name, {}).get(c, '-'):>10}" for c in TIME_COLUMNS)
        print(f"{name:<24} {findings[name]:>9} {outcome.get(name, '-'):>9} {spent}")
    ran = [n for n in outcome if outcome[n] != "SKIPPED"]
    ok = bool(ran) and all(outcome[n] == "PASSED" for n in ran) and set(ran) <= set(findings)
    return 0 if ok and sum(findings.values()) == 0 else 1


def _entry_names() -> list[str]:
    from kernels.kit.kernel_set import KernelSet

    return [f.name for f in dataclasses.fields(KernelSet) if f.name != "capturable"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--table", metavar="LOG", help="count a run's findings per kernel entry")
    ap.add_argument("--modes", metavar="LOG", help="count a churn run's findings per KV mode")
    ap.add_argument(
        "--layers",
        type=int,
        help="model layers (default: the preset's); 1 for racecheck and synccheck (see above)",
    )
    args = ap.parse_args()
    if args.table:
        return table(args.table)
    if args.modes:
        return modes(args.modes)
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if args.layers is not None and args.layers < 1:
        ap.error(f"--layers must be >= 1, got {args.layers}")
    return run(device, args.layers)


if __name__ == "__main__":
    sys.exit(main())
