"""bench/kernels/sglang_anchor.py maps our plan's state onto SGLang's swap-in arguments: the
same resident set at the same hot rows, the same LRU order, each token's host row where our
plan copies it from; the miss fraction of a step is exact. Checked on CPU against the plan's
PyTorch reference; on a GPU with SGLang's wheels, against both kernels (gpu marker)."""

from __future__ import annotations

import pytest
import torch

from bench.kernels import sglang_anchor as sgl
from bench.kernels import sglang_swap_cases
from kernels.formats import MODE_OFFLOADED
from kernels.reference.swap import ref_swap_plan

BS, K, W, B, P, CTX = 3, 6, 4, 20, 4, 48  # hot = B - W = 16 LRU slots


class _State:
    """Our plan state for BS offloaded requests, on CPU, planned by the reference."""

    def __init__(self) -> None:
        i32 = torch.int32
        self.seq_lens = torch.tensor([CTX, CTX - 5, CTX - 9], dtype=i32)
        self.req_slots = torch.tensor([2, 0, 1], dtype=i32)  # batch row b is request slot r
        self.page_table = torch.randperm(BS * CTX // P).to(i32).view(BS, CTX // P)
        self.token_slot = torch.full((1, BS, CTX), -1, dtype=i32)
        self.slot_token = torch.full((1, BS, B), -1, dtype=i32)
        self.lru_order = torch.arange(W, B, dtype=i32).repeat(1, BS, 1).contiguous()
        self.out_slots = torch.empty((BS, K), dtype=i32)
        self.src = torch.empty((BS, K), dtype=torch.int64)
        self.dst = torch.empty((BS, K), dtype=torch.int64)
        self.count = torch.empty((BS,), dtype=i32)

    def plan(self, topk: torch.Tensor) -> None:
        mode = torch.full((BS,), MODE_OFFLOADED, dtype=torch.int32)
        hit_flag = torch.zeros((BS, B), dtype=torch.int8)
        ref_swap_plan(
            0, topk, self.seq_lens, self.req_slots, mode, self.page_table, self.token_slot,
            self.slot_token, self.lru_order, hit_flag, self.out_slots, self.src, self.dst,
            self.count, num_layers=1, page_size=P, window=W,
        )  # fmt: skip

    def args(self, topk: torch.Tensor) -> sgl.SglangArgs:
        return sgl.from_plan(
            topk, self.seq_lens, self.req_slots, self.page_table, self.slot_token,
            self.lru_order, ctx=CTX, page_size=P, window=W,
        )  # fmt: skip

    def locs(self) -> torch.Tensor:
        return sgl.our_locs(self.out_slots, self.req_slots, B, BS)


# Positions every request holds outside its window: the shortest request's [0, seq_len - W).
LOW = CTX - 9 - W


def _first(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(LOW, generator=g)[:K] for _ in range(BS)]).to(torch.int32)


def test_state_maps_to_the_same_slots_rows_and_lru_order() -> None:
    st, first = _State(), _first()
    st.plan(first)  # every entry a miss: the plan names each token's host row and hot row
    a = st.args(first)
    assert int(st.count.sum()) == BS * K
    hot = B - W
    assert torch.equal(a.device_buffer_tokens[:, :hot], st.slot_token[0, :, W:])
    assert bool((a.device_buffer_tokens[:, hot] == -1).all())
    assert torch.equal(a.lru_slots.long(), st.lru_order[0].long() - W)
    assert torch.equal(sgl.expected_host_locs(a), st.src)  # host rows: where ours copies from
    assert torch.equal(st.locs(), st.dst)  # hot rows: where ours copies to
    r = st.req_slots.long()
    sglang_slot = st.out_slots.long() - W
    assert torch.equal(a.device_buffer_locs[r[:, None], sglang_slot].long(), st.dst)
    newest = r * B + (st.seq_lens.long() - 1) % W  # the newest token's window ring slot
    assert torch.equal(a.device_buffer_locs[r, hot].long(), newest)


def _lru_rule(a: sgl.SglangArgs, b: int) -> list[int]:
    """The hot rows the victim rule both kernels follow gives batch row b: a hit keeps its
    slot; the misses, in top-k order, take the slots not hit, least recently used first."""
    r, sel = int(a.req_pool_indices[b]), a.top_k_tokens[b].tolist()
    tokens = a.device_buffer_tokens[r, : a.hot].tolist()
    slot_of = {t: s for s, t in enumerate(tokens) if t >= 0}
    free = iter([s for s in a.lru_slots[r].tolist() if tokens[s] not in set(sel)])
    slots = [slot_of[t] if t in slot_of else next(free) for t in sel]
    return [int(a.device_buffer_locs[r, s]) for s in slots]


@pytest.mark.parametrize("frac", [0.0, 0.5, 1.0])
def test_the_next_step_takes_the_same_victims_through_the_mapping(frac: float) -> None:
    st, first = _State(), _first()
    st.plan(first)
    step = sgl.next_selection(first, LOW, frac, seed=3)
    a = st.args(step)  # the state before the step, as SGLang reads it
    want = [_lru_rule(a, b) for b in range(BS)]
    st.plan(step)
    assert int(st.count.sum()) == BS * round(K * frac)
    assert st.locs().tolist() == want


@pytest.mark.parametrize("frac", [0.0, 0.1, 0.5, 1.0])
def test_next_selection_replaces_exactly_the_fraction_with_unheld_positions(frac: float) -> None:
    first = torch.stack([torch.randperm(100)[:40] for _ in range(5)]).to(torch.int32)
    step = sgl.next_selection(first, 100, frac, seed=1)
    n = round(40 * frac)
    assert step.dtype == torch.int32 and step.shape == first.shape
    assert torch.equal(step[:, n:], first[:, n:])
    for row, old in zip(step.tolist(), first.tolist()):
        assert len(set(row)) == 40 and all(0 <= t < 100 for t in row)
        assert len(set(row) - set(old)) == n  # each new position is a miss
    assert torch.equal(step, sgl.next_selection(first, 100, frac, seed=1))
    with pytest.raises(ValueError, match="new positions"):
        sgl.next_selection(first, 70, 1.0)  # 40 new beside 40 held need 80 positions


def test_what_sglang_reads_differently_is_refused() -> None:
    st, first = _State(), _first()
    st.plan(first)
    window = first.clone()
    window[0, 0] = CTX - 2  # in our window, not the newest token: SGLang has no slot for it
    with pytest.raises(ValueError, match="window"):
        st.args(window)
    newest = first.clone()
    newest[0, 0] = CTX - 1  # the newest token: SGLang's extra slot, our ring slot
    st.args(newest)
    padded = first.clone()
    padded[1, 3] = -1
    with pytest.raises(ValueError, match="seq_len"):
        st.args(padded)
    st.req_slots[2] = -1
    with pytest.raises(ValueError, match="padding"):
        st.args(first)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU answer")
def test_without_cuda_the_anchor_says_why_and_the_case_gives_one_row() -> None:
    assert sgl.available() == "needs CUDA"
    (row,) = sglang_swap_cases.sglang_swap_case({}, 1)
    assert row.note == "needs CUDA" and row.us != row.us  # NaN: nothing measured


@pytest.mark.gpu
@pytest.mark.skipif(sgl.available() is not None, reason=f"SGLang's kernel: {sgl.available()}")
@pytest.mark.parametrize("fmt,d", sglang_swap_cases.FORMATS)
def test_both_kernels_expose_the_host_rows_of_the_top_k(fmt: str, d: int) -> None:
    pair = sglang_swap_cases._Pair(2, d)
    for frac in (0.0, 0.3, 1.0):
        row = sglang_swap_cases._row(pair, fmt, frac, reps=2)
        assert "rows equal" in row.note, row.note
        assert row.us > 0 and row.ratio > 0
        assert "same slots: yes" in row.note  # the shared victim rule, on the GPU
