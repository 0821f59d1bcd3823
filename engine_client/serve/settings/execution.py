"""How the engine executes the model: the device, the kernels (Triton or the torch
references), CUDA graphs, CPU threads and batch-invariant arithmetic."""

from __future__ import annotations

from dataclasses import dataclass

from contract.flags import setting
from contract.rules import check_settings, one_of, within
from kernels.kit.kernel_set import CHOICES as KERNELS

DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class Execution:
    device: str = setting(
        "auto",
        help=f"{', '.join(DEVICES)}; service modes use the service's GPU",
        check=one_of(DEVICES),
    )
    kernels: str = setting(
        "auto",
        help=f"{', '.join(KERNELS)}: auto is Triton on CUDA and the "
        "torch references on CPU (Triton's interpreter is ~30x slower)",
        check=one_of(KERNELS),
    )
    cuda_graphs: bool = setting(
        True, help="capture the decode step as CUDA graphs per batch bucket"
    )
    cpu_threads: int = setting(
        1,
        help="torch CPU threads; more than the free cores makes OpenMP "
        "spin against the KV service and slows CPU mode down by 10-30x",
        check=within(1, 1024),
    )
    batch_invariant: bool = setting(
        False,
        help="1: every GEMM and norm of the model through batch-invariant kernels (kernels/dense/: "
        "fixed K walk, no split-K, tiles chosen without M), so a row's logits never depend on "
        "its batch: greedy MTP equals plain decoding bit for bit; costs speed "
        "(docs/DECISIONS.md)",
    )

    def __post_init__(self) -> None:
        check_settings(self)

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
