"""The model runner: what launches a decode step on the model, graphed or eager (its speculative
variant, verify + draft, is `engine_client.model.speculative_runner`). The engine's step loop
(`engine_client.loop.step_runner.StepRunner`) calls it; it owns static input/output buffers,
batch-size buckets, and one CUDA graph per bucket.

A step copies the batch into fixed-address device buffers (padded to the next bucket with
request slot -1 rows, which change no state), then replays the bucket's graph (or runs the same
code eagerly: on CPU, with graphs off, or for a backend that cannot be captured). The captured
code allocates only from the graph's private pool, never synchronizes and reads no device value
on the host; its output is the static `logits` buffer.

Token feedback: `last_token[r]` holds the newest sampled token of request slot r on the device.
A row staged with token id -1 reads its input token from there, so the engine can launch step
t + 1 before step t's tokens reach the host (overlap). The engine writes it after sampling
(`remember`), in stream order, so the next step reads the value of the step before it.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from engine_client.model.forward_batch import Tokens
from engine_client.model.model import Model
from engine_client.model.progress import Progress
from engine_client.model.workspace import Workspace


@dataclass(frozen=True)
class DecodeConfig:
    """max_batch: most rows per step; buckets: the padded batch sizes (ascending, the last one
    max_batch); use_graphs: capture CUDA graphs when the device and backend allow it."""

    max_batch: int
    buckets: tuple[int, ...] = ()
    use_graphs: bool = True

    def __post_init__(self) -> None:
        if self.max_batch <= 0:
            raise ValueError(f"max_batch must be positive, got {self.max_batch}")
        if not self.buckets:
            pow2 = tuple(
                1 << i for i in range(self.max_batch.bit_length()) if 1 << i < self.max_batch
            )
            object.__setattr__(self, "buckets", pow2 + (self.max_batch,))
        b = self.buckets
        if list(b) != sorted(set(b)) or b[0] <= 0 or b[-1] != self.max_batch:
            raise ValueError(f"buckets must be ascending, positive and end at max_batch: {b}")

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)


# Rows of the staged input matrix.
_IDS, _SLOTS, _POS, _LENS = range(4)


@contextlib.contextmanager
def _forked(stream: torch.cuda.Stream, device: torch.device) -> Iterator[None]:
    """Launches inside go to `stream`, ordered after the current stream's work so far and
    joined back into it at the end."""
    cur = torch.cuda.current_stream(device)
    stream.wait_stream(cur)
    with torch.cuda.stream(stream):
        yield
    cur.wait_stream(stream)


class ModelRunner:
    """Runs decode steps of `model` on static buffers, graphed per bucket where it can. `step`
    returns a view of the static logits buffer: read (or copy) it before the next step."""

    def __init__(self, model: Model, cfg: DecodeConfig, rows_per_request: int = 1) -> None:
        """rows_per_request: forward rows per request of a step (a verify step's D + 1); the
        staged inputs have one row per request, logits and scratch rows_per_request each."""
        be = model.backend
        if cfg.max_batch > be.max_batch:
            raise ValueError(f"max_batch {cfg.max_batch} exceeds what the backend holds")
        self.model, self.cfg, self.device = model, cfg, model.device
        m = cfg.max_batch
        self.rows_per_request = rows_per_request
        self.inputs = torch.zeros((4, m), dtype=torch.int32, device=self.device)
        cuda = self.device.type == "cuda"
        # Two pinned staging buffers, alternated: with overlap one may still be in its copy.
        self._staging = [torch.zeros((4, m), dtype=torch.int32, pin_memory=cuda) for _ in range(2)]
        # Recorded after each staging copy: a pinned buffer is rewritten only once it is read.
        self._staged = [torch.cuda.Event() if cuda else None for _ in range(2)]
        # Entry R (padding rows) stays 0.
        self.last_token = torch.zeros(be.max_requests + 1, dtype=torch.int32, device=self.device)
        self._pad_slot = be.max_requests
        self.logits = torch.zeros(
            (m * rows_per_request, model.cfg.vocab_size), dtype=torch.float32, device=self.device
        )
        self.ws = Workspace.allocate(
            model.cfg, m * rows_per_request, be.max_context, self.device, row_format=be.layout.row
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.use_graphs = cfg.use_graphs and self.device.type == "cuda" and be.capturable
        self._pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.steps = 0

    @contextlib.contextmanager
    def on_compute(self) -> Iterator[None]:
        """Launches inside go to the backend's compute stream (if any), forked from the
        caller's stream and joined back into it."""
        # The backend's, read at each use: a benchmark may give its copy other SMs.
        compute = self.model.backend.compute_stream
        if compute is None:
            yield
            return
        with _forked(compute, self.device):
            yield

    def _body(self, bs: int) -> None:
        x = self.inputs[:, :bs]
        lens = x[_LENS]
        fed = self.last_token[torch.where(x[_SLOTS] >= 0, x[_SLOTS], self._pad_slot).long()]
        ids = torch.where(x[_IDS] >= 0, x[_IDS], fed)
        tok = Tokens(
            ids=ids, req_slots=x[_SLOTS], positions=x[_POS], seq_lens=lens, append_lens=lens
        )
        hidden = self.model.forward(tok, self.ws.rows(bs))
        self.model.logits(hidden, out=self.logits[:bs])

    def _check(
        self,
        token_ids: Sequence[int],
        positions: Sequence[int],
        req_slots: Sequence[int],
        seq_lens: Sequence[int],
    ) -> None:
        be = self.model.backend
        self._check_rows(token_ids, req_slots)
        if not len(token_ids) == len(positions) == len(seq_lens):
            raise ValueError("a step takes rows of equal-length inputs")
        if not 0 <= min(positions) <= max(positions) < be.max_context or any(
            s - p != 1 for p, s in zip(positions, seq_lens)
        ):
            raise ValueError(f"need 0 <= position < {be.max_context} and seq_len == position + 1")

    def _check_rows(self, token_ids: Sequence[int], req_slots: Sequence[int]) -> None:
        """The rows' count, request slots and token ids (builtins over the lists: this runs
        on the host path of every step)."""
        n, be = len(token_ids), self.model.backend
        if not 0 < n <= self.cfg.max_batch or n != len(req_slots):
            raise ValueError(f"a step takes 1..{self.cfg.max_batch} rows of equal-length inputs")
        if len(set(req_slots)) != n or not 0 <= min(req_slots) <= max(req_slots) < be.max_requests:
            raise ValueError(f"request slots must be distinct and in [0, {be.max_requests})")
        if not -1 <= min(token_ids) <= max(token_ids) < self.model.cfg.vocab_size:
            raise ValueError(
                f"token ids must be in [0, {self.model.cfg.vocab_size}) or -1 "
                "(the slot's last sampled token)"
            )

    def _stage(self, rows: list[Sequence[int]]) -> None:
        """Copy the batch, padded, into the static inputs: one host -> device copy."""
        k = self.steps % 2
        staged = self._staged[k]
        if staged is not None:
            staged.synchronize()  # the copy of two steps ago: long done
        st = self._staging[k]
        n = len(rows[0])
        st[:, :n] = torch.tensor(rows, dtype=torch.int32)
        st[:, n:] = 0
        st[_SLOTS, n:] = -1
        # The whole buffer: both sides contiguous, and rows past bs are padding anyway.
        self.inputs.copy_(st, non_blocking=True)
        if staged is not None:
            staged.record()

    def remember(self, tokens: torch.Tensor, n: int) -> None:
        """Store tokens [n] (device) as the last tokens of the request slots of the step just
        run, for the next step to read (rows staged with token id -1)."""
        self.last_token.index_copy_(0, self.inputs[_SLOTS, :n].long(), tokens.to(torch.int32))

    def remember_slot(self, req_slot: int, token: torch.Tensor) -> None:
        """Store token [1] (device) as the last token of `req_slot` (a prefill's first token)."""
        self.last_token[req_slot : req_slot + 1].copy_(token.to(torch.int32))

    def step(
        self,
        token_ids: Sequence[int],
        positions: Sequence[int],
        req_slots: Sequence[int],
        seq_lens: Sequence[int],
    ) -> torch.Tensor:
        """One decode step: each row appends token_ids[i] (-1: the slot's `last_token`) at
        positions[i] of request slot req_slots[i] (seq_lens[i] = positions[i] + 1, the length
        after the append), runs every layer, and returns fp32 logits [n, vocab] (a view of the
        static buffer)."""
        self._check(token_ids, positions, req_slots, seq_lens)
        n = len(token_ids)
        bs = self.cfg.bucket(n)
        if self.use_graphs and bs not in self.graphs:
            self.capture(bs)
        with self.on_compute():
            self._stage([token_ids, req_slots, positions, seq_lens])
            if self.use_graphs:
                self.graphs[bs].replay()
            else:
                self._body(bs)
        self.steps += 1
        return self.logits[: n * self.rows_per_request]

    def drop_graphs(self) -> None:
        """Forget every captured graph (each holds the addresses it was captured on, such as a
        lost KV service's memory) and capture later ones into a new pool. The caching allocator
        keeps a pool whose graphs are all gone until `empty_cache` frees its blocks, with a use
        count of 0; capturing into that pool id again trips its `use_count > 0` assert
        (CUDACachingAllocator's create_or_incref_pool)."""
        self.graphs.clear()
        if not self.use_graphs:
            return
        with torch.cuda.device(self.device):
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # gives the old pool's blocks back, and its id with them
        self._pool = torch.cuda.graph_pool_handle()

    def capture(self, *buckets: int) -> None:
        """Capture the graphs of `buckets` (default: all) not captured yet, largest first so
        smaller ones reuse its pool. Warm-up and capture run on padding-only inputs, which
        change no state."""
        if not self.use_graphs:
            return
        self.inputs.zero_()
        self.inputs[_SLOTS].fill_(-1)
        todo = sorted(set(buckets or self.cfg.buckets) - set(self.graphs), reverse=True)
        with Progress("warm-up and CUDA graph capture", len(todo), "batch bucket") as progress:
            for bs in todo:
                with self.on_compute():
                    self._capture_bucket(bs)
                progress.update()
        torch.cuda.current_stream(self.device).synchronize()

    def _capture_bucket(self, bs: int) -> None:
        self.graphs[bs] = self._graph_of(self._body, bs)

    def _graph_of(self, body: Callable[[int], None], bs: int) -> torch.cuda.CUDAGraph:
        """body(bs) warmed up, then captured into a graph (in this runner's pool)."""
        # Warm-up off the capture: compiles Triton kernels, creates cuBLAS workspaces.
        with _forked(torch.cuda.Stream(self.device), self.device):
            body(bs)
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA work of the engine's other threads must not abort the capture.
        # No garbage collection inside it: a collected pinned tensor (an earlier engine's in
        # the same process) queries CUDA events on free, which invalidates a capture.
        gc_was_on = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(
                graph,
                pool=self._pool,
                stream=self.model.backend.compute_stream,
                capture_error_mode="thread_local",
            ):
                body(bs)
        finally:
            if gc_was_on:
                gc.enable()
        return graph
