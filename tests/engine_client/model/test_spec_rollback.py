"""Speculative verify steps through every backend, rollback included, against the window-ring
trap: a verify step's rows at p + 1 .. p + D overwrite the ring slots of tokens p + 1 - W ..
p + D - W, which the row at p (and, after a rejection rolls the request back, the next step)
still counts as recent. A top-k source forces every row to read its whole causal window and
the tokens just older than it (those that rejected rows wrote a few steps before and the next
step rewrote), with acceptance scripted to reject at every depth. Every backend must hand
attention the same bytes: the logits of HiSparse (in-stream and remote swap, resident and
offloaded requests) equal the all-on-GPU baseline's bit for bit, step after step, and so do
the MTP layer's outputs, whose drafting rows are shorter than the verify rows of their step."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from contract.layout import MODE_OFFLOADED, MODE_RESIDENT, KVLayout
from engine_client.kv.baseline import BaselineBackend
from engine_client.kv.hisparse import HiSparseBackend
from engine_client.kv.remote_swap import RemoteSwapBackend, allocate_exchange, local_swap_fn
from engine_client.model.model import Model
from engine_client.model.model_runner import DecodeConfig
from engine_client.model.preset import preset
from engine_client.model.speculative_runner import SpeculativeModelRunner
from engine_client.model.weights import random_weights
from kernels.kit.kernel_set import KernelSet
from kv_service.memory.store import allocate_local, reset_request
from tests.engine_client.loop.test_engine import one_cpu_thread  # noqa: F401 (autouse: one CPU thread)

D, W, K = 3, 4, 8
CFG = preset("tiny", topk=K, mtp_layers=1)
# k (D + 1) = 32 = B - W: the union of a verify step's rows always fits.
LAYOUT = KVLayout(
    num_layers=CFG.kv_layers,
    max_requests=3,
    hot_slots=K * (D + 1) + W,
    window=W,
    topk=K,
    page_size=4,
    num_pages=64,
    max_context=80,
)
# slot: synthetic context (slot 2 is resident: its whole reservation fits the 36 hot slots).
CONTEXT = {0: 40, 2: 9}
STEPS = 8
# Drafts accepted at each step: every depth, rejections of 1..3 rows.
ACCEPT = [0, 3, 1, 2, 0, 3, 2, 1]


class WindowTopk:
    """Each row selects its W newest positions (its causal window) and the K - W just older:
    exactly the tokens the ring trap would corrupt, and then recently rewritten ones."""

    def __call__(self, layer, req_slots, seq_lens, out) -> None:
        pos = seq_lens.long()[:, None] - 1 - torch.arange(K, device=seq_lens.device)
        out.copy_(torch.where(pos >= 0, pos, -1).flip(1).to(out.dtype))


def backend(mode: str, kernels: KernelSet, device: str, layout: KVLayout):
    if mode == "baseline":
        return BaselineBackend(layout, kernels=kernels, device=device)
    kv = allocate_local(layout, device)
    for slot, start in zip(CONTEXT, (0, 30)):
        mode_of = MODE_RESIDENT if slot == 2 else MODE_OFFLOADED
        reset_request(kv, slot, mode_of, list(range(start, start + layout.max_pages_per_request)))
    if mode == "embedded":
        return HiSparseBackend(kv, kernels=kernels, max_batch=2, rows_per_request=D + 1)
    xchg = allocate_exchange(layout, device)
    swap = local_swap_fn(kv, xchg, kernels)
    return RemoteSwapBackend(
        kv, swap, kernels=kernels, xchg=xchg, max_batch=2, rows_per_request=D + 1
    )


def recording_mtp_block(model: Model, out: list[torch.Tensor]) -> None:
    """Keep every output of the MTP layer's block (KV layer num_layers)."""
    block = model.block

    def recorded(i, *args):
        x = block(i, *args)
        if i == CFG.num_layers:
            out.append(x.clone())
        return x

    model.block = recorded  # type: ignore[method-assign]


def run(mode: str, kernels: KernelSet, weights, device: str, layout: KVLayout):
    be = backend(mode, kernels, device, layout)
    model = Model(CFG, weights, be)
    model.topk_source = WindowTopk()
    out: list[torch.Tensor] = []
    if device == "cpu":  # graphs replay the block without calling it: CUDA checks the logits
        recording_mtp_block(model, out)
    # On CUDA the verify and draft steps replay CUDA graphs (remote swap runs eagerly).
    runner = SpeculativeModelRunner(model, DecodeConfig(max_batch=2), D)
    slots, counts = list(CONTEXT), torch.zeros(3, dtype=torch.int64)
    for slot, n in CONTEXT.items():
        be.fill_synthetic(slot, n, seed=slot, chunk=16)
        # Any drafts: acceptance is scripted.
        runner.drafts[slot] = torch.arange(D, device=device) + 5 * slot
    base = list(CONTEXT.values())
    for step in range(STEPS):
        logits = runner.step([7, 9], base, slots)
        out.append(logits.clone())
        y = logits.argmax(dim=-1).view(len(slots), D + 1)
        a = torch.full((len(slots),), ACCEPT[step], dtype=torch.int64, device=device)
        runner.draft(y, a)
        counts += be.counts.sum(dim=0).cpu()
        be.counts.zero_()
        base = [p + ACCEPT[step] + 1 for p in base]
    return out, counts, be, base


@pytest.mark.parametrize("row_format", ["bf16", "fp8"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_rollback_and_ring_trap_read_the_right_rows_in_every_backend(device, row_format) -> None:
    """CPU: the reference kernels; CUDA: the Triton kernels and CUDA graphs. Both row
    formats (fp8: DeepSeek-V3.2's 656 B rows, dequantized by attention)."""
    kernels = KernelSet.reference() if device == "cpu" else KernelSet.triton()
    weights = random_weights(CFG, seed=3, device=device)
    layout = dataclasses.replace(LAYOUT, row_format=row_format)
    base, _, full, lens = run("baseline", kernels, weights, device, layout)
    # Per step: verify logits, and on CPU the MTP layer over the verify rows and D - 1
    # drafting passes. On CUDA the drafts still feed the next step's verify rows, so the
    # logits check the MTP layer's argmax there.
    assert len(base) == STEPS * (D + 1 if device == "cpu" else 1)
    for mode in ("embedded", "remote"):
        outs, counts, be, _ = run(mode, kernels, weights, device, layout)
        assert len(outs) == len(base)
        for i, (a, b) in enumerate(zip(base, outs)):
            assert torch.equal(a, b), (mode, i)
        # The host tier holds the accepted row of every stored position of the offloaded
        # request, rejected-then-rewritten ones included (what a later miss copies).
        kv, P = be.kv, layout.page_size
        for layer in range(layout.num_layers):
            for t in range(lens[0]):
                host = kv.host_kv[kv.page_table[0, t // P], layer, t % P]
                assert torch.equal(
                    layout.row.attn_rows(host)[0], full.full_kv[layer, 0, t].to(host.device)
                )
        selected, misses, misses_rows = counts.tolist()
        # The offloaded request's rows shared their misses: each copied once.
        assert 0 < misses < misses_rows, (mode, counts)
