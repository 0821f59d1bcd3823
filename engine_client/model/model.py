"""DeepSeek-V3.2-shaped decode model, its layers: MLA with absorbed decode, the lightning
indexer's projections, optional dense SwiGLU MLP, norms and the output head. What the layers
hand the KV backend and read back (append, indexer scores, top-k, the rows to attend, sparse
MLA over them) is the attention glue, `engine_client.model.attention`; the tokens of one
forward are `engine_client.model.forward_batch.Tokens`.

Per layer, for n tokens (a decode batch, or one request's prefill chunk):
  h = RMSNorm(x)
  query:  qr = RMSNorm_qa(q_a_proj h); q = q_b_proj qr -> q_nope [H, nope], q_pe [H, 64] (RoPE)
  KV row: kv_a_proj_with_mqa h -> RMSNorm_kva(c_kv [512]) ++ RoPE(k_pe [64])  (576 bf16 values)
  indexer: q_I = wq_b qr [64, 128]; key = LayerNorm(wk h) [128] (RoPE on the first 64 dims of
          both, half-split as V3.2's indexer); w = weights_proj(h) / sqrt(64 * 128)
  backend.append(rows, keys) -> scores = sum_h w_h relu(q_I,h . key_t) -> top-k (t < seq_len)
  attention: q_nope absorbed through W_UK to [H, 512]; sparse MLA over the backend's rows;
          latent out through W_UV [H, v], then o_proj; residual; MLP; residual.
V3.2's Hadamard rotation of indexer q/k and fp8 activation quantization are not modelled.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch
import torch.nn.functional as F

from engine_client.kv.backend import KVBackend
from engine_client.model.attention import Queries, SparseAttention, TopkSource, row_parts
from engine_client.model.forward_batch import PrefillChunk, Tokens
from engine_client.model.part_tail import PartTails
from engine_client.model.preset import ModelConfig
from engine_client.model.rope import RopeTable
from engine_client.model.weights import check_weights, layer_prefix
from engine_client.model.workspace import Workspace


class Model:
    """Weights + forward. `backend` decides where KV lives; the math is the same for all.

    batch_invariant: GEMMs and norms through the kernel set's batch-invariant ones
    (kernels/dense/), so a row's logits never depend on its batch (docs/DECISIONS.md).
    tail_parts > 1: decode layers run their tail in that many row parts, each right after its
    attention (engine_client.model.part_tail); every KV mode must get the same value.
    late_queries: the attention's queries (q_b_proj, W_UK, q_pe's RoPE) are launched after every
    part's swap-in plan instead of before the first, so they run beside the miss copies
    (SparseAttention.attend); the same ops on the same inputs, so no bit moves."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights: dict[str, torch.Tensor],
        backend: KVBackend,
        *,
        batch_invariant: bool = False,
        tail_parts: int = 1,
        late_queries: bool = False,
    ) -> None:
        check_weights(weights, cfg)
        if tail_parts < 1:
            raise ValueError(f"tail_parts must be positive, got {tail_parts}")
        if backend.topk != cfg.topk:
            raise ValueError(f"backend top-k {backend.topk} != model top-k {cfg.topk}")
        if backend.num_layers != cfg.kv_layers:
            raise ValueError(
                f"backend has {backend.num_layers} layers, model {cfg.num_layers} "
                f"+ {cfg.mtp_layers} MTP"
            )
        self.cfg, self.backend, self.kernels = cfg, backend, backend.kernels
        self.batch_invariant, self.tail_parts = batch_invariant, tail_parts
        self.late_queries = late_queries
        self.device = backend.device
        w = {n: t.to(self.device) for n, t in weights.items()}
        self.embed, self.final_norm, self.lm_head = (
            w["model.embed_tokens.weight"],
            w["model.norm.weight"],
            w["lm_head.weight"],
        )
        self.layers = [self._layer_weights(w, i) for i in range(cfg.num_layers)]
        # V3.2's MTP layer (engine_client.model.mtp): KV layer num_layers of the backend.
        self.mtp = self._layer_weights(w, cfg.num_layers) if cfg.mtp_layers else None
        self.rope = RopeTable(cfg.rope_dim, backend.max_context, cfg.rope_theta, self.device)
        self.attention = SparseAttention(cfg, backend)
        self.topk_source: TopkSource | None = None

    def _layer_weights(self, w: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
        cfg, p = self.cfg, layer_prefix(i)
        lw = {n[len(p) :]: t for n, t in w.items() if n.startswith(p)}
        kv_b = lw.pop("self_attn.kv_b_proj.weight").view(
            cfg.num_heads, cfg.qk_nope_dim + cfg.v_head_dim, cfg.kv_lora_rank
        )
        # Absorbed decode: q_nope @ W_UK per head, and latent @ W_UV^T per head.
        lw["w_uk"] = kv_b[:, : cfg.qk_nope_dim].contiguous()
        lw["w_uv_t"] = kv_b[:, cfg.qk_nope_dim :].transpose(1, 2).contiguous()
        return lw

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x @ w.T: cuBLAS (its kernel and split-K follow M), or the batch-invariant GEMM."""
        return self.kernels.linear(x, w) if self.batch_invariant else F.linear(x, w)

    def bmm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.kernels.bmm(a, b) if self.batch_invariant else torch.bmm(a, b)

    def norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """RMSNorm with the model's eps (PyTorch's reduction shapes its blocks by M too, so the
        batch-invariant mode takes the kernel set's one-row-a-program norm instead)."""
        eps = self.cfg.norm_eps
        return (self.kernels.rms_norm if self.batch_invariant else self.kernels.norm)(x, w, eps)

    def forward(
        self, tok: Tokens, ws: Workspace, prefill: PrefillChunk | None = None
    ) -> torch.Tensor:
        """Hidden states [n, hidden] after the final norm; decode (backend.select) unless
        `prefill` says the tokens are one request's chunk."""
        return self.final(self.hidden_states(tok, ws, prefill))

    def final(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm of the last layer's output."""
        return self.norm(x, self.final_norm)

    def hidden_states(
        self, tok: Tokens, ws: Workspace, prefill: PrefillChunk | None = None
    ) -> torch.Tensor:
        """The last decoder layer's output [n, hidden], before the final norm (what V3.2's MTP
        layer takes)."""
        x = F.embedding(tok.ids, self.embed)
        cos, sin = self.rope.lookup(tok.positions)
        for i, lw in enumerate(self.layers):
            x = self.block(i, lw, x, cos, sin, tok, ws, prefill)
        return x

    def block(
        self,
        i: int,
        lw: dict,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        tok: Tokens,
        ws: Workspace,
        prefill: PrefillChunk | None,
    ) -> torch.Tensor:
        """One decoder block on KV layer i: attention, then the MLP (if any), each residual. A
        decode forward with tail_parts > 1 runs both residuals of each part's rows as soon as
        that part's attention is launched (engine_client.model.part_tail)."""
        if prefill is not None or self.tail_parts == 1:
            self._attend(i, lw, x, cos, sin, tok, ws, prefill)
            return self._mlp(lw, self._out_proj(lw, x, ws, slice(0, x.shape[0])))
        parts = row_parts(x.shape[0], self.tail_parts, tok.rows_per_request)
        tails = PartTails(x, parts, lambda r, out: self._mlp(lw, self._out_proj(lw, x, ws, r), out))
        self._attend(i, lw, x, cos, sin, tok, ws, prefill, tails)
        return tails.finish()

    def _out_proj(self, lw: dict, x: torch.Tensor, ws: Workspace, r: slice) -> torch.Tensor:
        """x[r] + o_proj of the attention's rows r through W_UV: the attention's residual."""
        o = self.bmm(ws.attn_out[r].transpose(0, 1), lw["w_uv_t"]).transpose(0, 1)
        return x[r] + self.linear(o.reshape(o.shape[0], -1), lw["self_attn.o_proj.weight"])

    def _mlp(self, lw: dict, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x + MLP(post-attention norm of x) (x itself without an MLP), into out if given."""
        if not self.cfg.mlp_hidden:
            return x if out is None else out.copy_(x)
        h = self.norm(x, lw["post_attention_layernorm.weight"])
        gate = F.silu(self.linear(h, lw["mlp.gate_proj.weight"]))
        up = self.linear(h, lw["mlp.up_proj.weight"])
        return torch.add(x, self.linear(gate * up, lw["mlp.down_proj.weight"]), out=out)

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits [n, vocab] of final hidden states [n, hidden], into out if given (the
        bf16 GEMM's values widened in the copy: one pass over [n, vocab], not a cast and a copy)."""
        h = self.linear(hidden, self.lm_head)
        return h.float() if out is None else out.copy_(h)

    def prefill(
        self, req_slot: int, token_ids: Sequence[int], *, start: int = 0, chunk_size: int = 512
    ) -> torch.Tensor:
        """Run one request's tokens at positions [start, start + len) in chunks: each chunk's
        rows and index keys are appended first, then every token selects its own top-k over
        positions <= itself and attends through backend.gather (never the plan kernel, which
        would move LRU state). The request slot must be admitted (service modes) with room for
        the tokens. Returns the fp32 logits [vocab] of the last token."""
        states = self.prefill_states(req_slot, token_ids, start=start, chunk_size=chunk_size)
        return self.logits(self.final(states[-1:]))[0]

    def prefill_states(
        self, req_slot: int, token_ids: Sequence[int], *, start: int = 0, chunk_size: int = 512
    ) -> torch.Tensor:
        """`prefill`'s work; returns every token's last-layer output [len, hidden] (pre-norm)."""
        n, be = len(token_ids), self.backend
        if n == 0 or chunk_size <= 0:
            raise ValueError(f"prefill needs tokens and a positive chunk size ({n}, {chunk_size})")
        if not 0 <= req_slot < be.max_requests or not 0 <= start <= be.max_context - n:
            raise ValueError(
                f"request slot {req_slot} / positions [{start}, {start + n}) out of "
                f"range (R={be.max_requests}, max_context={be.max_context})"
            )
        ids = torch.tensor(token_ids, dtype=torch.int64)
        if int(ids.min()) < 0 or int(ids.max()) >= self.cfg.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.cfg.vocab_size})")
        ids = ids.to(self.device)
        states = []
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            tok, ws = self.chunk(req_slot, ids[s:e], start + s)
            states.append(self.hidden_states(tok, ws, PrefillChunk(req_slot, start + e)))
        return torch.cat(states)

    def chunk(self, req_slot: int, ids: torch.Tensor, start: int) -> tuple[Tokens, Workspace]:
        """The tokens and scratch of one prefill chunk: ids [n] at positions [start, start + n)
        of request slot req_slot."""
        e = start + ids.shape[0]
        pos = torch.arange(start, e, dtype=torch.int32, device=self.device)
        tok = Tokens(ids, torch.full_like(pos, req_slot), pos, pos + 1, torch.full_like(pos, e))
        # Chunks are wide batches: single-pass attention, no split scratch to allocate.
        return tok, Workspace.allocate(self.cfg, e - start, e, self.device, attn_splits=1)

    def _indexer(
        self, lw: dict, h: torch.Tensor, qr: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Indexer query [n, 64, 128] bf16, head weights [n, 64] fp32, key [n, 128]."""
        cfg, n, r = self.cfg, h.shape[0], self.cfg.rope_dim
        q = self.linear(qr, lw["self_attn.indexer.wq_b.weight"]).view(
            n, cfg.index_heads, cfg.index_dim
        )
        # RoPE on the first r dims of both, in place (q and k are this call's own tensors).
        self.kernels.rotate(q[..., :r], cos, sin, interleaved=False, out=q[..., :r])
        k = self._key_norm(lw, self.linear(h, lw["self_attn.indexer.wk.weight"]))
        self.kernels.rotate(k[:, :r], cos, sin, interleaved=False, out=k[:, :r])
        w = (
            self.linear(h, lw["self_attn.indexer.weights_proj.weight"]).float()
            * cfg.index_weight_scale
        )
        return q, w, k

    def _key_norm(self, lw: dict, k: torch.Tensor) -> torch.Tensor:
        """The indexer key's LayerNorm in fp32, back in k's dtype."""
        w, b = lw["self_attn.indexer.k_norm.weight"], lw["self_attn.indexer.k_norm.bias"]
        if self.batch_invariant:
            return self.kernels.layer_norm(k, w, b, self.cfg.norm_eps)
        shape = (self.cfg.index_dim,)
        return F.layer_norm(k.float(), shape, w.float(), b.float(), self.cfg.norm_eps).to(k.dtype)

    def _attend(
        self,
        i: int,
        lw: dict,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        tok: Tokens,
        ws: Workspace,
        prefill: PrefillChunk | None,
        after_part: PartTails | None = None,
    ) -> None:
        """Norm, projections, store, indexer and sparse attention of layer i into ws.attn_out
        (after_part: SparseAttention.attend's)."""
        h = self.norm(x, lw["input_layernorm.weight"])
        qr, rows = self._project(lw, h, cos, sin)
        iq, iw, ik = self._indexer(lw, h, qr, cos, sin)
        self.attention.store(i, rows, ik, tok)
        queries: Queries = partial(self._queries, lw, qr, cos, sin)
        if not self.late_queries:  # launched now; attend gets them back as they are
            queries = partial(tuple, queries())
        self.attention.attend(i, queries, (iq, iw), tok, ws, prefill, self.topk_source, after_part)

    def _queries(
        self, lw: dict, qr: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention's queries from the normed query latent: q_nope absorbed through W_UK
        [n, H, 512] and q_pe rotated [n, H, 64]."""
        cfg, n = self.cfg, qr.shape[0]
        q = self.linear(qr, lw["self_attn.q_b_proj.weight"]).view(n, cfg.num_heads, cfg.qk_head_dim)
        q_abs = self.bmm(q[..., : cfg.qk_nope_dim].transpose(0, 1), lw["w_uk"]).transpose(0, 1)
        return q_abs, self.kernels.rotate(q[..., cfg.qk_nope_dim :], cos, sin, interleaved=True)

    def _project(
        self, lw: dict, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """MLA's projections before the indexer: the normed query latent (the indexer's and the
        queries' input) and the KV rows to store (latent + rope)."""
        cfg = self.cfg
        qr = self.norm(
            self.linear(h, lw["self_attn.q_a_proj.weight"]), lw["self_attn.q_a_layernorm.weight"]
        )
        kv = self.linear(h, lw["self_attn.kv_a_proj_with_mqa.weight"])
        c_kv = self.norm(kv[:, : cfg.kv_lora_rank], lw["self_attn.kv_a_layernorm.weight"])
        rows = torch.cat(
            (c_kv, self.kernels.rotate(kv[:, cfg.kv_lora_rank :], cos, sin, interleaved=True)), -1
        )
        return qr, rows
