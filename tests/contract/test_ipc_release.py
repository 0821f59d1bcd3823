"""contract.ipc_release: the bookkeeping that proves a lost service's CUDA IPC mappings closed
(any storage works, so it runs on CPU), and the removal of a dead exporter's counter files."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from contract.ipc_release import IpcMappings, counter_files_of, remove_counter_files
from tests.service_harness import short_tmpdir


class _Backend:
    def __init__(self, t: torch.Tensor) -> None:
        self.rows = t[1:3]  # a view keeps the whole storage alive


def test_released_storages_are_forgotten_and_held_ones_are_named() -> None:
    m = IpcMappings()
    a, b = torch.zeros(8, dtype=torch.int32), torch.zeros(4, dtype=torch.uint8)
    m.add("hot_kv", a)
    m.add("page_table", b)
    keeper = _Backend(a)
    del a, b
    left = m.unreleased()
    assert [x.name for x in left] == ["hot_kv"]
    assert left[0].nbytes == 32
    assert any("_Backend.rows" in h for h in left[0].holders), left[0].holders
    assert "hot_kv (32 B" in str(left[0])
    assert len(m) == 0 and m.unreleased() == []  # reported once
    del keeper


def test_a_cycle_alone_does_not_keep_a_storage() -> None:
    m = IpcMappings()
    t = torch.ones(3)
    m.add("x", t)
    cycle: list[object] = [t]
    cycle.append(cycle)
    del t, cycle
    assert m.unreleased() == []


@pytest.fixture
def shm():
    path = short_tmpdir("hsipc")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_counter_files_of_a_dead_exporter_are_removed(shm: str) -> None:
    mine = f"/torch_{os.getpid()}_123_0"
    dead = "/torch_4194999_7_1"
    other = "/hisparse-x-1-hot_kv"
    for name in (mine, dead, other):
        open(os.path.join(shm, name.lstrip("/")), "w").close()
    assert counter_files_of(4194999, shm) == [dead]
    live = (os.getpid(), dead)  # named by a live exporter: its owner unlinks it
    assert remove_counter_files([live], shm_dir=shm) == (0, [live])
    ghost = 4194999  # above Linux's largest pid: never alive
    assert remove_counter_files([(ghost, dead), (ghost, dead), (ghost, other)], shm) == (1, [])
    assert sorted(os.listdir(shm)) == sorted(n.lstrip("/") for n in (mine, other))
