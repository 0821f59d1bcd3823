"""Naming every kernel of the decode step (issue 30): which part of the model launched it.

bench.profile groups the captured step's kernels by name, and a name says what a Triton kernel
of ours is but not why PyTorch ran an elementwise, reduce or GEMM kernel: in the fp8 step a third
of the kernel time fell in "other". Kernels inside a CUDA graph replay carry no launching op, so
the parts come from one more, eager pass over the same step: `named_parts` wraps the model's
functions in `part::<name>` profiler ranges, and `family` charges each kernel to the innermost
part it was launched in (GEMMs split by part: projections, MLP, logits). The eager pass launches
the same kernels; kernel durations, not the gaps between them, are what it measures.

`kernel_kind` (bench.shared.kernel_names) is the name-only split of PyTorch's own kernels
(elementwise, reduce, cat, copy, ...), for the graphed pass where no part is known.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

from torch.profiler import record_function

from bench.shared.kernel_names import OTHER, category, is_gemm, kernel_kind

PART_RANGE = "part::"
KERNEL_RANGE = "kernel::"

# part -> (family of its GEMMs, family of its other kernels). Innermost part wins.
PART_FAMILIES = {
    "norm": ("norms", "norms"),
    "rope": ("rope", "rope"),
    "index_quantize": ("quantize index keys", "quantize index keys"),
    "indexer_qkw": ("indexer q/k/w projections", "indexer q/k prep (layer norm, cat, casts)"),
    "index_scores": ("indexer", "indexer glue"),
    "select": ("plan glue", "plan glue"),
    "count": ("select: hit/miss counters", "select: hit/miss counters"),
    "row_base": ("select: row bases", "select: row bases"),
    "append": ("append", "append glue"),
    "trace_topk": ("trace top-k (bench input)", "trace top-k (bench input)"),
    "attention": ("MLA projections (q_a, q_b, kv_a, absorb, o)", "MLA glue (cat, copies, add)"),
    "block": ("MLP/GEMM", "MLP elementwise (silu, mul, add)"),
    "embed": ("embedding, rope table", "embedding, rope table"),
    "logits": ("logits (lm_head)", "logits cast and copy"),
    "step": ("engine glue (inputs, logits buffer)", "engine glue (inputs, logits buffer)"),
}


def family(kernel: str, parts: list[str]) -> str:
    """Family of one kernel: a kernel of ours by its own name (`category`), any other by the
    innermost part (`parts`, innermost first) and whether it is a GEMM."""
    cat = category(kernel)
    if cat not in (OTHER, "MLP/GEMM"):
        return cat
    gemm = is_gemm(kernel)
    for p in parts:
        if p in PART_FAMILIES:
            return PART_FAMILIES[p][0 if gemm else 1]
    return f"outside the model: {kernel_kind(kernel)}"


def _wrap(name: str, fn: Callable) -> Callable:
    def call(*a, **kw):
        with record_function(PART_RANGE + name):
            return fn(*a, **kw)

    return call


@contextlib.contextmanager
def _patched(obj, attr: str, name: str) -> Iterator[None]:
    old = getattr(obj, attr)
    setattr(obj, attr, _wrap(name, old))
    try:
        yield
    finally:
        setattr(obj, attr, old)


@contextlib.contextmanager
def _kernel_part(model, field: str, name: str) -> Iterator[None]:
    """The model's kernel-set `field` inside part `name` (the set is frozen: swap in a copy)."""
    old = model.kernels
    model.kernels = dataclasses.replace(old, **{field: _wrap(name, getattr(old, field))})
    try:
        yield
    finally:
        model.kernels = old


@contextlib.contextmanager
def _index_formats(name: str) -> Iterator[None]:
    """Every index-key format's encode inside part `name` (a frozen dataclass: swap entries)."""
    from kernels.formats import INDEX_FORMATS

    old = dict(INDEX_FORMATS)
    for k, f in old.items():
        INDEX_FORMATS[k] = dataclasses.replace(f, encode=_wrap(name, f.encode))
    try:
        yield
    finally:
        INDEX_FORMATS.update(old)


@contextlib.contextmanager
def named_parts(runner) -> Iterator[None]:
    """Within: the runner's eager step runs each part of the model in a `part::` range."""
    model, be = runner.model, runner.model.backend
    with contextlib.ExitStack() as st:
        st.enter_context(_patched(model, "norm", "norm"))
        st.enter_context(_kernel_part(model, "rotate", "rope"))
        st.enter_context(_index_formats("index_quantize"))
        for attr, name in (
            ("_indexer", "indexer_qkw"),
            ("_attend", "attention"),
            ("_out_proj", "attention"),
            ("block", "block"),
            # Innermost wins: a part tail's MLP runs inside the attention (--decode-part-tail).
            ("_mlp", "block"),
            ("hidden_states", "embed"),
            ("logits", "logits"),
        ):
            st.enter_context(_patched(model, attr, name))
        for attr in ("index_scores", "select", "append"):
            st.enter_context(_patched(be, attr, attr))
        # HiSparse's select: its stats counters and its row bases, apart from the plan.
        for attr, name in (("_count", "count"), ("_hot", "row_base")):
            if hasattr(be, attr):
                st.enter_context(_patched(be, attr, name))
        if model.topk_source is not None:
            st.enter_context(_patched(model, "topk_source", "trace_topk"))
        st.enter_context(_patched(runner, "_body", "step"))
        yield


def parts_of(event) -> list[str]:
    """The `part::` ranges around a profiler event, innermost first."""
    out, p = [], event
    while p is not None:
        if p.name.startswith(PART_RANGE):
            out.append(p.name[len(PART_RANGE) :])
        p = p.cpu_parent
    return out


def families_us(step: Callable[[int], None], runner, n: int, device) -> dict:
    """µs per family summed over n eager steps with the parts named. On CUDA each kernel is
    charged through the call that launched it; kernels of no known launch stay
    "unlinked" (by kind). On CPU each op's self time goes to its innermost kernel:: range or
    part."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    graphs, runner.use_graphs = runner.use_graphs, False
    try:
        with named_parts(runner):
            step(1)  # the first eager step of a graphed runner may compile or allocate
            if cuda:
                torch.cuda.synchronize(device)
            with profile(activities=acts) as prof:
                step(n)
                if cuda:
                    torch.cuda.synchronize(device)
    finally:
        runner.use_graphs = graphs
    return _charge(prof.events(), cuda)


def _charge(events, cuda: bool) -> dict[str, float]:
    out: dict[str, float] = {}

    def add(fam: str, us: float) -> None:
        out[fam] = out.get(fam, 0.0) + us

    if not cuda:
        for e in events:
            add(family(charged_name(e), parts_of(e)), e.self_cpu_time_total)
        return out
    # A kernel shares its correlation id with the runtime or driver call that launched it
    # (cudaLaunchKernel; cuLaunchKernelEx for Triton), a CPU event nested in the ranges.
    launches = {e.id: e for e in events if _is_launch(e)}
    for e in events:
        if not _is_device_work(e):
            continue
        launch = launches.get(e.id)
        if launch is None:
            cat = category(e.name)
            fam = cat if cat not in (OTHER, "MLP/GEMM") else f"unlinked: {kernel_kind(e.name)}"
        else:
            fam = family(e.name, parts_of(launch))
        add(fam, e.time_range.elapsed_us())
    return out


def _is_launch(e) -> bool:
    import torch

    return e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("cu")


def _is_device_work(e) -> bool:
    """A kernel, copy or fill on the device; not the ranges the profiler also projects onto
    the device's timeline (gpu_user_annotation: part::, kernel::, ProfilerStep)."""
    import torch

    return e.device_type != torch.autograd.DeviceType.CPU and not e.name.startswith(
        (PART_RANGE, KERNEL_RANGE, "ProfilerStep")
    )


def charged_name(e) -> str:
    """CPU runs: the innermost kernel:: range (bench.profile.breakdown's named kernels) around e."""
    p = e
    while p is not None:
        if p.name.startswith(KERNEL_RANGE):
            return p.name
        p = p.cpu_parent
    return e.name


def per_step(us: dict[str, float], steps: int, step_us: float) -> dict[str, dict]:
    """µs per step and share of the timed step, largest first."""
    rows = {k: v / steps for k, v in sorted(us.items(), key=lambda kv: -kv[1])}
    return {k: {"us_per_step": v, "share": v / step_us} for k, v in rows.items()}


def print_families(r: dict) -> None:
    for key, title in (
        ("other_kinds", "'other' of the profiled step by kernel kind"),
        ("by_kernel", "the shared phase's launches by kernel"),
        ("families", "every kernel by the model part that launched it (eager pass)"),
    ):
        if r.get(key):
            print(f"\n{title}:")
            for name, v in r[key].items():
                print(f"  {name:<48} {v['us_per_step']:>10.1f} {100 * v['share']:>5.1f}%")
