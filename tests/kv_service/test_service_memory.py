"""The service's start-up export (kv_service.memory.segment.export_service_memory): memory
first (every tensor of memory.service_specs, initialized), exported in one call
under one owner lock, after
the files of a dead owner are gone; removed in one call at exit."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from contract.exchange import exchange_specs
from contract.layout import MODE_FREE
from contract.segment_map import SegmentMap
from contract.tensors import TENSOR_NAMES
from kv_service.memory import segment, shm_file
from tests.process_harness import LAYOUT


def test_one_export_shares_every_tensor_initialized(tmp_path: Path) -> None:
    shm = str(tmp_path)
    shared = segment.export_service_memory(LAYOUT, torch.device("cpu"), shm, "svc")
    try:
        assert shared.removed_stale == []
        assert [h["name"] for h in shared.kv_handles] == list(TENSOR_NAMES)
        assert [h["name"] for h in shared.exchange_handles] == list(exchange_specs(LAYOUT))
        mem = shared.memory
        assert (mem.kv.req_mode == MODE_FREE).all() and (mem.kv.page_table == -1).all()
        assert (mem.exchange["xchg_req_slots"] == -1).all()
        assert (mem.exchange["xchg_topk"] == -1).all()
        # What the engine maps is the same memory: a write here is seen there.
        peer = SegmentMap()
        xchg = peer.map_extra(shared.exchange_handles, "cpu")
        mem.exchange["xchg_seq_lens"][0] = 77
        assert xchg["xchg_seq_lens"][0] == 77
        files = [e.name for e, _ in shm_file.scan(shm)]
        assert len(files) == len(TENSOR_NAMES) + len(exchange_specs(LAYOUT))
        assert all(str(os.getpid()) in f for f in files)
    finally:
        segment.remove_segments(shm, "svc")
    assert os.listdir(shm) == []
