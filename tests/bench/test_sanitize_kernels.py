"""bench/sanitize/cli.py's tables: the sanitizer's findings are counted against the kernel
entry whose launch marker follows them, and an entry that never launched fails the table; in
the churn's log, against the KV mode whose marker precedes them, with each mode's outcome and
where its seconds went. (The driver itself runs on the H200 under compute-sanitizer,
bench/sanitize.sh.)"""

from __future__ import annotations

from pathlib import Path

from bench.sanitize.cli import MARKER, MODE_MARKER, _entry_names, modes, table

HEADER = "========= COMPUTE-SANITIZER\n"
RACE = (
    "========= Error: Race reported between Write access at 0x1f0 in k.py:12:_topk_kernel\n"
    "=========     and Read access at 0x2a0 in k.py:14:_topk_kernel [4 hazards]\n"
)
SUMMARY = "========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)\n"


def _log(tmp_path: Path, body: str) -> str:
    path = tmp_path / "run.log"
    path.write_text(body)
    return str(path)


def test_findings_go_to_the_launch_they_precede(tmp_path: Path, capsys) -> None:
    marks = "".join(f"{MARKER}{n}\n" for n in _entry_names())
    body = HEADER + marks + RACE + f"{MARKER}topk_select\n" + marks + f"{MARKER}(end)\n" + SUMMARY
    assert table(_log(tmp_path, body)) == 1  # a finding fails it
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()}
    assert rows["topk_select"] == ["3", "1"]
    assert rows["kv_append"] == ["2", "0"]


def test_a_clean_run_passes_and_a_missing_entry_fails(tmp_path: Path, capsys) -> None:
    names = _entry_names()
    clean = HEADER + "".join(f"{MARKER}{n}\n" for n in names) + SUMMARY
    assert table(_log(tmp_path, clean)) == 0
    partial = HEADER + "".join(f"{MARKER}{n}\n" for n in names[1:]) + SUMMARY
    assert table(_log(tmp_path, partial)) == 1
    assert f"never launched: {names[0]}" in capsys.readouterr().out


def _outcome(word: str, mode: str) -> str:
    return (
        f"{word} tests/integration/test_engine_stress.py::test_churn_under_overlap_on_gpu[{mode}]\n"
    )


def test_churn_findings_go_to_the_mode_they_follow(tmp_path: Path, capsys) -> None:
    body = (
        HEADER
        + f"{MODE_MARKER}embedded\n"
        + "@@sanitize-time embedded service 0.0 engine 9.5 churn 31.2 steps 18 "
        + "(stop 2 length 1 cancelled 7)\n"
        + f"{MODE_MARKER}service\n"
        + RACE  # the service process's, reported as that mode ran
        + SUMMARY
        + f"{MODE_MARKER}service-remote-swap\n"
        + "".join(_outcome("PASSED", m) for m in ("embedded", "service-remote-swap"))
        + _outcome("FAILED", "service")
    )
    assert modes(_log(tmp_path, body)) == 1
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()}
    assert rows["embedded"] == ["0", "PASSED", "18", "0.0", "9.5", "31.2", "2/1/7"]
    assert rows["service"] == ["1", "FAILED", "-", "-", "-", "-", "-"]  # one race, not two lines
    assert rows["service-remote-swap"][:2] == ["0", "PASSED"]


def test_a_clean_churn_passes_and_a_mode_without_its_marker_fails(tmp_path: Path) -> None:
    clean = HEADER + f"{MODE_MARKER}baseline\n" + SUMMARY + _outcome("PASSED", "baseline")
    assert modes(_log(tmp_path, clean)) == 0
    unmarked = HEADER + SUMMARY + _outcome("PASSED", "baseline")
    assert modes(_log(tmp_path, unmarked)) == 1, "findings could not be told by mode"


def test_the_driver_launches_every_kernel_entry(capsys, monkeypatch) -> None:
    """The kernel pass itself, on CPU (Triton's interpreter), one layer: its runs together
    launch every KernelSet entry. On the H100 (2026-12-05) it exited 1 under every sanitizer
    because nothing ran the batch-invariant entries."""
    from bench.sanitize import cli
    from kernels.kit.kernel_set import KernelSet

    # run() wraps KernelSet.triton for the process; this test's ends with it.
    monkeypatch.setattr(KernelSet, "triton", KernelSet.__dict__["triton"])
    # One request just past the hot buffer (33 prompt tokens, 32 slots: misses, the miss copy;
    # 4 pages of 8 and 1) decoding 2 tokens: the driver's runs at a fraction of its work (CPU
    # time in CI, most of it the interpreted prefill of the prompt).
    monkeypatch.setattr(cli, "PROMPTS", ((33, 2),))
    cli.LAUNCHES.clear()
    assert cli.run("cpu", layers=1) == 0, capsys.readouterr().out[-400:]
    assert all(cli.LAUNCHES[name] > 0 for name in _entry_names())
