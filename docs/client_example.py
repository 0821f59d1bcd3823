"""A plain decode loop on another engine's side, using only the client library and the kernels.

Run against a service: python docs/client_example.py unix:/tmp/kv.sock (docs/CLIENT.md).
It attaches (mapping the service's KV memory), admits one request, appends its prompt's KV,
then per decode step and per layer appends the new token's row and swaps in the top-k rows
in-stream, checks that the hot rows attention would read are the rows it appended, reports the
step, and releases.
"""

import asyncio
import sys

import torch

from engine_client.client import KVClient, KVLayout, KVTensors, StepReport
from kernels.store.append import kv_append
from kernels.swap.miss_copy import miss_copy
from kernels.swap.plan import swap_plan


def row(layout: KVLayout, layer: int, pos: int) -> torch.Tensor:
    """A stand-in for the model's KV row of token `pos` in `layer` (any bytes will do)."""
    g = torch.Generator().manual_seed(layer * 100_000 + pos)
    return torch.randint(0, 256, (layout.row_bytes,), dtype=torch.uint8, generator=g)


def append(kv: KVTensors, layer: int, slot: int, positions: list[int], seq_len: int) -> None:
    dev, n = kv.device, len(positions)
    rows = torch.stack([row(kv.layout, layer, p) for p in positions]).to(dev)
    index_rows = torch.zeros((n, kv.layout.index_bytes), dtype=torch.uint8, device=dev)
    slots, pos, lens = (
        torch.tensor(v, dtype=torch.int32, device=dev)
        for v in ([slot] * n, positions, [seq_len] * n)
    )
    kv_append(
        layer,
        rows,
        index_rows,
        slots,
        pos,
        lens,
        kv.req_mode,
        kv.page_table,
        kv.host_rows,
        kv.hot_kv,
        kv.index_pool,
        window=kv.layout.window,
        row_format=kv.layout.row,
        index_format=kv.layout.index,
    )


def swap_in(
    kv: KVTensors, layer: int, slot: int, topk: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, int]:
    """Plan this layer's swap-in, copy the misses host -> hot; return the hot slots and misses."""
    lay, dev, k = kv.layout, kv.device, topk.shape[1]
    out = torch.full((1, k), -1, dtype=torch.int32, device=dev)
    src, dst = (torch.zeros((1, k), dtype=torch.int64, device=dev) for _ in range(2))
    count = torch.zeros((1,), dtype=torch.int32, device=dev)
    seq_lens = torch.tensor([seq_len], dtype=torch.int32, device=dev)
    slots = torch.tensor([slot], dtype=torch.int32, device=dev)
    swap_plan(
        layer,
        topk,
        seq_lens,
        slots,
        kv.req_mode,
        kv.page_table,
        kv.token_slot,
        kv.slot_token,
        kv.lru_order,
        kv.hit_flag,
        out,
        src,
        dst,
        count,
        num_layers=lay.num_layers,
        page_size=lay.page_size,
        window=lay.window,
    )
    miss_copy(kv.host_rows, kv.hot_kv, src, dst, count)
    return out[0], int(count[0])


async def decode(target: str, prompt_len: int = 20, new_tokens: int = 4) -> int:
    """Returns the number of rows swapped in from the host tier."""
    client = await KVClient.connect(target, engine_name="example-engine")
    try:
        kv, lay = client.tensors, client.layout
        adm = await client.admit("req-0", prompt_len, new_tokens)
        for layer in range(lay.num_layers):  # prefill: the prompt's rows
            append(kv, layer, adm.slot, list(range(prompt_len)), prompt_len)
        await client.commit("req-0", prompt_len)
        seq_len, misses = prompt_len, 0
        for step in range(new_tokens):
            seq_len, step_misses = seq_len + 1, 0  # this step's token
            # Stand-in for the indexer's top-k: distinct positions, padded with -1.
            picked = torch.randperm(seq_len)[: lay.topk].to(torch.int32)
            topk = torch.full((1, lay.topk), -1, dtype=torch.int32)
            topk[0, : len(picked)] = picked
            topk = topk.to(kv.device)
            for layer in range(lay.num_layers):
                append(kv, layer, adm.slot, [seq_len - 1], seq_len)
                hot, missed = swap_in(kv, layer, adm.slot, topk, seq_len)
                step_misses += missed
                # What sparse attention reads for this layer: hot rows at the planned slots.
                read = kv.hot_kv[layer, adm.slot, hot[: len(picked)].long()].cpu()
                want = torch.stack([row(lay, layer, int(p)) for p in picked])
                assert torch.equal(read, want), f"layer {layer}: hot rows differ"
            misses += step_misses
            await client.step_end(StepReport(step, (("req-0", seq_len),), misses=step_misses))
        await client.release("req-0")
        return misses
    finally:
        await client.close(detach=True)


if __name__ == "__main__":
    print(f"rows swapped in: {asyncio.run(decode(sys.argv[1]))}")
