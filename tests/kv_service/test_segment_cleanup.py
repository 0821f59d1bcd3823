"""Removal of shared segment files: a failed create leaves none of its own (and never touches
a file it did not make), remove_segments leaves none, and the files of a killed service of the
same instance are removed while a live owner's stay."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from contract.segment_map import SegmentMap
from kv_service.memory import segment
from tests.kv_service.test_segment import LAYOUT, ROOT


def test_failed_create_removes_its_partial_files(tmp_path: Path) -> None:
    squatter = tmp_path / f"hisparse-part-{os.getpid()}-lru_order"
    squatter.write_bytes(b"mine")
    with pytest.raises(FileExistsError):
        segment.create_segments(LAYOUT, "cpu", str(tmp_path), "part")
    assert os.listdir(tmp_path) == [squatter.name] and squatter.read_bytes() == b"mine"


def test_remove_segments_leaves_no_files(tmp_path: Path) -> None:
    segs = SegmentMap()
    kv, handles = segment.create_segments(LAYOUT, "cpu", str(tmp_path), "rm")
    segment.export_extra({"buf": torch.zeros(4)}, "cpu", str(tmp_path), "rm")
    (tmp_path / "unrelated").write_text("x")
    assert segs.is_owner_alive(handles)
    segment.remove_segments(str(tmp_path), "rm")
    assert os.listdir(tmp_path) == ["unrelated"]
    assert not segs.is_owner_alive(handles)
    segment.remove_segments(str(tmp_path), "rm")
    kv.hot_kv.fill_(1)  # the mapping outlives the names; nothing may crash


CHILD = """
import json, sys, time, torch
from kernels.uva import UVATensor
from kv_service.memory import segment
from contract.layout import KVLayout
layout = KVLayout(**json.loads(sys.argv[1]))
kv, handles = segment.create_segments(layout, "cpu", sys.argv[2], "dead")
print(json.dumps([{**h, "ipc": ""} for h in handles]), flush=True)
time.sleep(300)
"""


def test_stale_segments_of_killed_process_are_removed(tmp_path: Path) -> None:
    segs = SegmentMap()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, json.dumps(LAYOUT.to_dict()), str(tmp_path)],
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line, "child failed to create segments"
        dead = [{**h, "ipc": b""} for h in json.loads(line)]
        assert segs.is_owner_alive(dead)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        proc.stdout.close()
    _, live = segment.create_segments(LAYOUT, "cpu", str(tmp_path), "live")
    parent = tmp_path / f"hisparse-other-{os.getppid()}-host_kv"
    parent.write_bytes(b"")
    try:
        assert not segs.is_owner_alive(dead)
        removed = segment.remove_stale_segments(str(tmp_path), "dead")
        assert sorted(removed) == sorted(h["path"] for h in dead)
        assert sorted(os.listdir(tmp_path)) == sorted(
            [parent.name, f"hisparse-live-{os.getpid()}.lock"]
            + [Path(h["path"]).name for h in live]
        )
        assert segment.remove_stale_segments(str(tmp_path), "dead") == []
    finally:
        segment.remove_segments(str(tmp_path), "live")
