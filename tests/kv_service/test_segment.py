"""Shared segments between two processes: byte-exact sharing both ways, handles, layout checks.
Their removal (this process's files, a killed process's):
tests/kv_service/test_segment_cleanup.py."""

from __future__ import annotations

import base64
import gc
import json
import multiprocessing as mp
import os
import traceback
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from contract import cuda_shm, handle
from contract.layout import KVLayout, LayoutError
from contract.segment_map import SegmentMap
from contract.tensors import TENSOR_NAMES, KVTensors
from kernels.uva import UVATensor
from kv_service.memory import segment
from tests.leftovers import SPAWNED

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = KVLayout(
    num_layers=2,
    max_requests=3,
    hot_slots=24,
    window=4,
    topk=16,
    page_size=4,
    num_pages=5,
    max_context=30,
    row_format="fp8",
    index_format="fp8",
)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _pattern(t: torch.Tensor, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (t.numel() * t.element_size(),), dtype=torch.uint8, generator=gen)


def _fill(tensors: dict[str, torch.Tensor], seed: int) -> None:
    for i, name in enumerate(sorted(tensors)):
        t = tensors[name]
        _bytes(t).copy_(_pattern(t, seed * 100 + i).to(t.device))


def _mismatched(tensors: dict[str, torch.Tensor], seed: int) -> list[str]:
    return [
        name
        for i, name in enumerate(sorted(tensors))
        if not torch.equal(_bytes(tensors[name]).cpu(), _pattern(tensors[name], seed * 100 + i))
    ]


def _as_dict(kv: KVTensors) -> dict[str, torch.Tensor]:
    return {name: getattr(kv, name) for name in TENSOR_NAMES}


def _run_child(target, *args) -> str:
    """Run `target(*args, conn)` in a spawned process; return what it sent ("ok" or a traceback)."""
    ctx = mp.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=target, args=(*args, child_conn))
    proc.start()
    SPAWNED.add(proc.pid)
    child_conn.close()
    result = parent_conn.recv() if parent_conn.poll(120) else "no answer"
    proc.join(60)
    if proc.exitcode is not None:  # what the CUDA driver left of the child (contract.cuda_shm)
        cuda_shm.remove_of(proc.pid)
    assert proc.exitcode == 0, f"child exit code {proc.exitcode}"
    return result


def _child_roundtrip(
    layout: dict, handles: list[dict], extra: list[dict], device: str, conn
) -> None:
    segs = SegmentMap()
    try:
        kv = segs.map_segments(KVLayout.from_dict(layout), handles, torch.device(device))
        extras = segs.map_extra(extra, torch.device(device))
        assert segs.is_owner_alive(handles) and segs.is_owner_alive(extra)
        assert not _mismatched(_as_dict(kv), 1), _mismatched(_as_dict(kv), 1)
        assert not _mismatched(extras, 3), _mismatched(extras, 3)
        if device == "cuda":
            assert kv.host_kv.is_pinned()
            assert torch.equal(
                _uva_copy(kv.host_rows.view(torch.uint8), kv.host_kv.numel()),
                _bytes(kv.host_kv).cuda(),
            )
        _fill(_as_dict(kv), 2)
        _fill(extras, 4)
        if device == "cuda":
            torch.cuda.synchronize()
        segs.unmap(kv)
        segs.unmap(extras)
        conn.send("ok")
    except BaseException:
        conn.send(traceback.format_exc())


def _roundtrip(tmp_path: Path, device: torch.device) -> None:
    kv, handles = segment.create_segments(LAYOUT, device, str(tmp_path), "rt")
    extras, extra_handles = segment.export_extra(
        {"slots": torch.zeros(3, 7, dtype=torch.int32, device=device), "stage": torch.ones(5, 9)},
        device,
        str(tmp_path),
        "rt",
    )
    try:
        _fill(_as_dict(kv), 1)
        _fill(extras, 3)
        if device.type == "cuda":
            torch.cuda.synchronize()
        result = _run_child(_child_roundtrip, LAYOUT.to_dict(), handles, extra_handles, device.type)
        assert result == "ok", result
        assert not _mismatched(_as_dict(kv), 2)
        assert not _mismatched(extras, 4)
        if device.type == "cuda":
            row = kv.host_kv[3, 1]
            assert torch.equal(_uva_copy(UVATensor(row), row.numel()), _bytes(row).cuda())
    finally:
        segment.remove_segments(str(tmp_path), "rt")


def test_writes_are_shared_both_ways(tmp_path: Path) -> None:
    _roundtrip(tmp_path, torch.device("cpu"))


def test_handles_describe_files(tmp_path: Path) -> None:
    kv, handles = segment.create_segments(LAYOUT, "cpu", str(tmp_path), "h-1")
    try:
        assert [h["name"] for h in handles] == list(TENSOR_NAMES)
        for h in handles:
            t = getattr(kv, h["name"])
            assert h["kind"] == "shm" and h["ipc"] == b"" and h["shape"] == list(t.shape)
            assert h["dtype"] == str(t.dtype).removeprefix("torch.")
            assert os.path.basename(h["path"]) == f"hisparse-h-1-{os.getpid()}-{h['name']}"
            assert os.stat(h["path"]).st_size == h["nbytes"] == t.numel() * t.element_size()
            assert os.stat(h["path"]).st_mode & 0o777 == 0o600
        assert (kv.page_table == -1).all() and (kv.lru_order[0, 0] == torch.arange(4, 24)).all()
        with pytest.raises(FileExistsError):
            segment.create_segments(LAYOUT, "cpu", str(tmp_path), "h-1")
        assert all(os.path.exists(h["path"]) for h in handles), "a failed create removed live files"
        with pytest.raises(ValueError):
            segment.create_segments(LAYOUT, "cpu", str(tmp_path), "../x")
    finally:
        segment.remove_segments(str(tmp_path), "h-1")


def _tampered(handles: list[dict], name: str, **change) -> list[dict]:
    return [{**h, **change} if h["name"] == name else h for h in handles]


def test_mismatch_is_refused(tmp_path: Path) -> None:
    segs = SegmentMap()
    _, handles = segment.create_segments(LAYOUT, "cpu", str(tmp_path), "mm")
    try:
        other = KVLayout(**{**LAYOUT.to_dict(), "num_pages": 6})
        bad = [
            (other, handles),
            (KVLayout(**{**LAYOUT.to_dict(), "row_format": "bf16"}), handles),
            (LAYOUT, _tampered(handles, "page_table", dtype="int64", nbytes=3 * 8 * 8)),
            (LAYOUT, _tampered(handles, "hot_kv", nbytes=1)),
            (LAYOUT, _tampered(handles, "hit_flag", shape=[3, 23], nbytes=69)),
            (LAYOUT, _tampered(handles, "req_mode", kind="cuda_ipc")),
            (LAYOUT, _tampered(handles, "req_mode", path="/etc/passwd")),
            (LAYOUT, _tampered(handles, "req_mode", dtype="Tensor")),
            (LAYOUT, handles[:-1]),
            (LAYOUT, handles + [{**handles[0], "name": "extra"}]),
            (LAYOUT, handles + [handles[0]]),
        ]
        for layout, hs in bad:
            with pytest.raises(LayoutError):
                segs.map_segments(layout, hs, "cpu")
        with pytest.raises(LayoutError):
            segs.map_extra(_tampered(handles, "req_mode", nbytes=5))
        kv = segs.map_segments(LAYOUT, handles, "cpu")
        segs.unmap(kv)
        assert kv.host_rows is None
    finally:
        segment.remove_segments(str(tmp_path), "mm")


def test_ipc_handle_codec() -> None:
    share = (0, b"\x01" * 64, 4096, 512, b"/torch_1_2_3", 7, b"\x00" * 64, True)
    pid, decoded = handle.decode_ipc(
        json.dumps(
            {
                "pid": 42,
                "share": [
                    {"b64": base64.b64encode(v).decode()} if isinstance(v, bytes) else v
                    for v in share
                ],
            }
        ).encode()
    )
    assert pid == 42 and tuple(decoded) == share
    for junk in (b"", b"{}", b'{"pid": 1, "share": [1, 2]}', b"\x80\x04K\x01."):
        with pytest.raises(LayoutError):
            handle.decode_ipc(junk)


def _uva_copy(src, n: int) -> torch.Tensor:
    """Copy n bytes from a UVA host view into device memory with a Triton kernel (zero-copy
    loads)."""
    import triton
    import triton.language as tl

    @triton.jit
    def copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < n), mask=offs < n)

    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    copy_kernel[(triton.cdiv(n, 1024),)](src, dst, n, BLOCK=1024)
    torch.cuda.synchronize()
    return dst


@pytest.fixture
def cuda_exports_released() -> Iterator[None]:
    """A CUDA IPC export here (`_share_cuda_`) puts a consumer count in a
    /dev/shm/torch_<pid>_* file of this (pytest's) process, set to 1 for the one consumer
    expected; the consumer's unmapping takes it to 0. The file goes once every exported storage
    is freed with a count of 0 and `ipc_collect` drops torch's current counter file: after the
    test, with its tensors gone, collect, and check that the file went."""
    before = _counter_files()
    yield
    gc.collect()
    torch.cuda.ipc_collect()
    assert _counter_files() - before == set(), "CUDA IPC counter files left by this process"


def _counter_files() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(f"torch_{os.getpid()}_")}


def _child_maps_and_unmaps(layout: dict, handles: list[dict], conn) -> None:
    """An engine's part in an export: map, then unmap (which takes its consumer count back)."""
    try:
        segs = SegmentMap()
        kv = segs.map_segments(KVLayout.from_dict(layout), handles, torch.device("cuda"))
        segs.unmap(kv)
        del kv
        conn.send("ok")
    except BaseException:
        conn.send(traceback.format_exc())


@pytest.mark.gpu
@pytest.mark.usefixtures("cuda_exports_released")
def test_gpu_writes_are_shared_both_ways(tmpfs_dir: str) -> None:
    """hot_kv and the extras by CUDA IPC, host_kv as a registered file read by Triton through
    UVA."""
    _roundtrip(Path(tmpfs_dir), torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.usefixtures("cuda_exports_released")
def test_gpu_handles_and_cleanup(tmpfs_dir: str) -> None:
    segs = SegmentMap()
    kv, handles = segment.create_segments(LAYOUT, "cuda", tmpfs_dir, "gpu")
    kinds = {h["name"]: h["kind"] for h in handles}
    assert kinds.pop("host_kv") == "shm" and set(kinds.values()) == {"cuda_ipc"}
    assert kv.host_kv.is_pinned() and kv.hot_kv.is_cuda and segs.is_owner_alive(handles)
    # Mapped once, as an engine would: an export nobody maps keeps its count (and its storage)
    # in torch's limbo until this process exits.
    assert _run_child(_child_maps_and_unmaps, LAYOUT.to_dict(), handles) == "ok"
    del kv
    segment.remove_segments(tmpfs_dir, "gpu")
    assert not os.path.exists(handles[0]["path"]) and not segs.is_owner_alive(handles)
