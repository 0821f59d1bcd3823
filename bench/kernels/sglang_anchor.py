"""SGLang's HiSparse swap-in kernel as a same-run anchor for our plan + miss copy (issue 38
item 3).

SGLang fuses the swap-in of one layer into one JIT-compiled CUDA kernel,
`load_cache_to_device_buffer_mla` in `sglang/jit_kernel/hisparse.py` (csrc/hisparse.cuh; the
module is `hisparse`, not `sparse`, in sglang 0.5.10.post1, the newest wheel our index serves;
0.5.9's wheel has no such module): one CTA per request finds the hits of the top-k among the
hot slots, gives each miss the least recently used slot that was not hit, and copies the missed
rows from pinned host memory with one warp per row. It compiles at first use through
apache-tvm-ffi, nvcc and ninja (`bash bench/device_wheels.sh sglang` fetches the three wheels).

Importing `sglang.jit_kernel.hisparse` the ordinary way runs `sglang/__init__.py`, which pulls
in the whole frontend and runtime (IPython, requests, pydantic, flashinfer, ...), none of it
carried to the device. So `_hisparse()` imports only the two files the kernel needs, by path:
it registers a bare `sglang` package (its `__init__` not run) and a stand-in `sglang.utils` whose
one name the JIT loader uses (`is_in_ci`), unless the real ones are already imported.

The mapping of our plan's state onto SGLang's arguments (`from_plan`), for one layer:
- SGLang's LRU-tracked hot slots are our B - W non-window slots: its slot j is our slot W + j,
  at the same flat hot row, so one hot buffer layout serves both; its LRU order (front = least
  recent) is our `lru_order` less W. Same resident set, same order: the same victims.
- Its extra slot (index B - W) holds a request's newest token: our window ring slot of it.
  SGLang has no window beyond that token, so a selection must avoid the rest of our window
  (`check_selection`); the benchmark draws from [0, ctx - W).
- Host rows: SGLang reads token t of request r at host row `host_cache_locs[r, t]`; we give it
  the flat host row our plan would copy from (page table, layer, page offset).
Both kernels then do the same work on the same inputs: same top-k, same resident set and LRU
order, same host rows, so the same hits, misses and (by their shared victim rule) slots.
"""

from __future__ import annotations

import glob
import importlib
import importlib.util
import os
import shutil
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

import torch

# SGLang's coordinator launches the kernel with 1024 threads per request (hisparse_coordinator).
BLOCK_SIZE = 1024


def _find(name: str):
    """The import spec of a top-level module, without importing it (None if absent)."""
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None


def _ninja_on_path() -> bool:
    """ninja where tvm-ffi's build runs it: PATH, else the `bin/` a `pip install --target` puts
    beside the ninja package (bench/gpu_session.sh installs the carried wheels that way)."""
    if shutil.which("ninja"):
        return True
    spec = _find("ninja")
    if spec is None or spec.origin is None:
        return False
    bin_dir = Path(spec.origin).parent.parent / "bin"
    if not (bin_dir / "ninja").is_file():
        return False
    os.environ["PATH"] = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    return True


def _cuda_home() -> str | None:
    """The CUDA toolkit tvm-ffi builds with: CUDA_HOME if set, else the first holding nvcc and
    lib64/libcudart.so (tvm-ffi links against it), put in CUDA_HOME. tvm-ffi's own guess, two
    levels above `which nvcc`, misses where nvcc on PATH is a wrapper script (it is here)."""
    given = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if given:
        return given
    nvcc = shutil.which("nvcc")
    found = [str(Path(os.path.realpath(nvcc)).parent.parent)] if nvcc else []
    found += ["/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*"), reverse=True)]
    for home in found:
        if (Path(home) / "bin" / "nvcc").is_file() and (Path(home) / "lib64/libcudart.so").exists():
            os.environ["CUDA_HOME"] = home
            return home
    return None


def available() -> str | None:
    """None if SGLang's swap-in kernel can be built and run here, else why not. Compiling is
    left to the first call (minutes); this only checks that everything it needs is present."""
    if not torch.cuda.is_available():
        return "needs CUDA"
    sgl = _find("sglang")
    if sgl is None or not sgl.submodule_search_locations:
        return "sglang is not installed (bash bench/device_wheels.sh sglang)"
    root = Path(list(sgl.submodule_search_locations)[0]) / "jit_kernel"
    if not (root / "hisparse.py").is_file() or not (root / "csrc" / "hisparse.cuh").is_file():
        return f"this sglang has no jit_kernel/hisparse.py (0.5.10.post1 has): {root}"
    if _find("tvm_ffi") is None:
        return "apache-tvm-ffi is not installed (bash bench/device_wheels.sh sglang)"
    if _cuda_home() is None:
        return "no CUDA toolkit (nvcc, lib64/libcudart.so): SGLang's kernel compiles at first use"
    if not _ninja_on_path():
        return "no ninja (tvm-ffi builds with it): bash bench/device_wheels.sh sglang"
    try:
        _hisparse()
        importlib.import_module("tvm_ffi")  # the JIT imports it only when it first builds
    except Exception as exc:  # ImportError, or a tvm-ffi library that will not load
        return f"SGLang's kernel module or tvm_ffi does not import: {exc!r}"[:200]
    return None


def _hisparse() -> types.ModuleType:
    """sglang.jit_kernel.hisparse, imported without sglang/__init__.py (module doc)."""
    if "sglang" not in sys.modules:
        spec = _find("sglang")
        if spec is None or not spec.submodule_search_locations:
            raise ImportError("sglang is not installed")
        pkg = types.ModuleType("sglang")
        pkg.__path__ = list(spec.submodule_search_locations)
        sys.modules["sglang"] = pkg
        if "sglang.utils" not in sys.modules:
            shim = types.ModuleType("sglang.utils")
            setattr(shim, "is_in_ci", lambda: False)
            sys.modules["sglang.utils"] = shim
    # Without this, importing tvm_ffi may JIT-build a torch DLPack add-on when torch lacks the
    # exchange API; its pure-Python fallback passes torch's current stream just the same.
    os.environ.setdefault("TVM_FFI_DISABLE_TORCH_C_DLPACK", "1")
    return importlib.import_module("sglang.jit_kernel.hisparse")


@dataclass
class SglangArgs:
    """SGLang's kernel arguments for one layer's swap-in, mapped from our plan state."""

    top_k_tokens: torch.Tensor  # [bs, k] int32: our topk tensor itself
    device_buffer_tokens: torch.Tensor  # [R, hot + 1] int32: token per slot (-1 empty)
    host_cache_locs: torch.Tensor  # [R, ctx] int64: host row per token
    device_buffer_locs: torch.Tensor  # [R, hot + 1] int32: flat hot row per slot
    top_k_device_locs: torch.Tensor  # [bs, k] int32: out, the hot row of each top-k entry
    req_pool_indices: torch.Tensor  # [bs] int64
    seq_lens: torch.Tensor  # [bs] int32
    lru_slots: torch.Tensor  # [R, hot] int16: slots, least recently used first
    num_real_reqs: torch.Tensor  # [1] int32
    hot: int  # LRU-tracked slots per request

    def snapshot(self) -> list[torch.Tensor]:
        return [self.device_buffer_tokens.clone(), self.lru_slots.clone()]

    def restore(self, snap: list[torch.Tensor]) -> None:
        self.device_buffer_tokens.copy_(snap[0])
        self.lru_slots.copy_(snap[1])


def check_selection(topk: torch.Tensor, seq_lens: torch.Tensor, window: int) -> None:
    """Refuse what SGLang's kernel would read differently from ours: entries outside
    [0, seq_len) (it has no padding: it would look up host row -1) and window positions
    other than the newest token (it keeps only that one outside its LRU)."""
    t, n = topk.long(), seq_lens.long()[:, None]
    if bool(((t < 0) | (t >= n)).any()):
        raise ValueError("every top-k entry must be a position in [0, seq_len)")
    if bool(((t >= n - window) & (t < n - 1)).any()):
        raise ValueError("top-k entries in the window other than the newest token")


def _slot_rows(seq_lens, req_slots, R: int, B: int, W: int, layer: int) -> torch.Tensor:
    """SGLang's device_buffer_locs [R, B - W + 1]: its slot j is our slot W + j at the same flat
    hot row; its extra slot is the ring slot of each batch request's newest token."""
    hot, dev = B - W, seq_lens.device
    base = (layer * R + torch.arange(R, device=dev, dtype=torch.int64)) * B
    locs = torch.empty((R, hot + 1), dtype=torch.int64, device=dev)
    locs[:, :hot] = base[:, None] + W + torch.arange(hot, device=dev)
    locs[:, hot] = base
    req = req_slots.long()
    locs[req, hot] = base[req] + (seq_lens.long() - 1) % W
    return locs.to(torch.int32)


def from_plan(
    topk: torch.Tensor,
    seq_lens: torch.Tensor,
    req_slots: torch.Tensor,
    page_table: torch.Tensor,
    slot_token: torch.Tensor,
    lru_order: torch.Tensor,
    *,
    ctx: int,
    page_size: int,
    window: int,
    layer: int = 0,
) -> SglangArgs:
    """SGLang's arguments for the state our plan (kernels/swap/plan.py) holds for `layer`;
    the tensors are new (topk and seq_lens shared), on topk's device."""
    L, R, B = slot_token.shape
    hot, W, P, dev = B - window, window, page_size, topk.device
    if not topk.shape[1] <= hot < 2**15:  # its hash keeps top-k indices, its LRU slots, in int16
        raise ValueError(f"need k <= B - W < 32768: k={topk.shape[1]} B={B} W={W}")
    if bool((req_slots < 0).any()) or (L * R * B) >= 2**31:
        raise ValueError("padding rows or hot rows past int32 have no SGLang equivalent")
    if bool((page_table[:, : -(-ctx // P)] < 0).any()):
        raise ValueError("every page of the context must be mapped")
    check_selection(topk, seq_lens, W)
    tokens = torch.full((R, hot + 1), -1, dtype=torch.int32, device=dev)
    tokens[:, :hot] = slot_token[layer, :, W:]
    t = torch.arange(ctx, device=dev)
    host_locs = (page_table[:, t // P].long() * L + layer) * P + t % P  # our plan's miss_src
    return SglangArgs(
        top_k_tokens=topk,
        device_buffer_tokens=tokens,
        host_cache_locs=host_locs.contiguous(),
        device_buffer_locs=_slot_rows(seq_lens, req_slots, R, B, W, layer),
        top_k_device_locs=torch.full_like(topk, -1),
        req_pool_indices=req_slots.long(),
        seq_lens=seq_lens,
        lru_slots=(lru_order[layer] - W).to(torch.int16).contiguous(),
        num_real_reqs=torch.tensor([topk.shape[0]], dtype=torch.int32, device=dev),
        hot=hot,
    )


def swap_call(
    args: SglangArgs, host: torch.Tensor, hot_rows: torch.Tensor, block_size: int = BLOCK_SIZE
) -> Callable[[], None]:
    """A call of SGLang's swap-in on `args`: hits and misses of top_k_tokens, LRU update, the
    missed rows copied from `host` (pinned [rows, D] uint8, read in place by the GPU) to
    `hot_rows` ([rows, D] uint8 on the GPU), top_k_device_locs written. The first call compiles
    (make it outside a graph capture); later ones are launch-only."""
    kernel = _hisparse().load_cache_to_device_buffer_mla
    # SglangArgs' tensor fields carry the kernel's own keyword names.
    tensors = {f.name: getattr(args, f.name) for f in fields(args) if f.name != "hot"}
    sizes = dict(item_size_bytes=host.shape[-1], num_top_k=args.top_k_tokens.shape[1])
    sizes |= dict(hot_buffer_size=args.hot, page_size=1, block_size=block_size)

    def call() -> None:
        kernel(host_cache=host, device_buffer=hot_rows, **tensors, **sizes)

    return call


def our_locs(
    out_slots: torch.Tensor,
    req_slots: torch.Tensor,
    hot_slots: int,
    num_requests: int,
    layer: int = 0,
) -> torch.Tensor:
    """The flat hot row of each entry of our plan's slot list ([bs, k] int64)."""
    return (layer * num_requests + req_slots.long())[:, None] * hot_slots + out_slots.long()


def expected_host_locs(args: SglangArgs) -> torch.Tensor:
    """The host row each top-k entry must read ([bs, k] int64)."""
    return args.host_cache_locs[args.req_pool_indices[:, None], args.top_k_tokens.long()]


def next_selection(first: torch.Tensor, hi: int, frac: float, seed: int = 0) -> torch.Tensor:
    """`first` ([bs, k], distinct positions in [0, hi) per row) with its first round(k frac)
    entries replaced by positions in [0, hi) that its row does not hold: against a hot buffer
    holding `first`, exactly that many misses per row, whatever the order of the rest."""
    bs, k = first.shape
    n = round(k * frac)
    if not 0 <= n <= hi - k:
        raise ValueError(f"cannot draw {n} new positions beside {k} in [0, {hi})")
    g = torch.Generator().manual_seed(seed)
    keys = torch.rand((bs, hi), generator=g)
    keys.scatter_(1, first.long().cpu(), 2.0)  # held positions sort last: never drawn
    step = first.clone()
    step[:, :n] = keys.argsort(dim=1)[:, :n].to(first.dtype).to(first.device)
    return step
