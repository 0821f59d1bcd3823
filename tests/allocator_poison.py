"""A CUDA caching allocator whose free blocks hold NaN: a test run after `poison_cuda_allocator`
sees NaN (or, as integers, 0x7fc00000) wherever a kernel reads memory that nothing wrote since
its allocation, instead of whatever an earlier test left there. Run AC's only GPU failure (the
part-tail test, bitwise in one process and not in the full suite) is what this looks for."""

from __future__ import annotations

import torch

# Sizes that land in both of the allocator's pools: small blocks (<= 1 MiB, cut from 2 MiB
# segments) and large ones.
SMALL_BYTES, SMALL_COUNT = 256 << 10, 256
LARGE_MIB = (1, 2, 4, 8, 16, 32, 64)


def poison_cuda_allocator(device: str = "cuda") -> int:
    """Fills freshly allocated blocks of both pools with NaN and frees them back into the cache;
    returns the bytes poisoned."""
    nan = float("nan")
    held = [torch.full((SMALL_BYTES // 4,), nan, device=device) for _ in range(SMALL_COUNT)]
    held += [torch.full((m << 18,), nan, device=device) for m in LARGE_MIB for _ in range(2)]
    torch.cuda.synchronize(device)
    poisoned = sum(t.numel() * 4 for t in held)
    del held  # back to the allocator's cache, not to the driver
    return poisoned
