"""Acceptance of a verify step's drafts (engine_client.loop.speculative): greedy takes the
longest prefix of drafts equal to the target's argmax; sampling keeps the target's
distribution exactly (checked empirically over many token keys: deterministic, not flaky).
And verify rows score tokens like plain decode rows (engine_client.model.speculative_runner)."""

from __future__ import annotations

import pytest
import torch

from contract import setting_groups
from engine_client.kv.baseline import BaselineBackend, baseline_layout
from engine_client.loop.sampler import derive, stream_key, token_key
from engine_client.loop.speculative import row_keys, verify
from engine_client.model.model import Model
from engine_client.model.model_runner import DecodeConfig, ModelRunner
from engine_client.model.preset import preset
from engine_client.model.speculative_runner import SpeculativeModelRunner
from engine_client.model.weights import random_weights
from kernels.kit.kernel_set import KernelSet


def one_hot_logits(rows: list[int], vocab: int = 6) -> torch.Tensor:
    out = torch.full((len(rows), vocab), -5.0)
    out[torch.arange(len(rows)), torch.tensor(rows)] = 5.0
    return out


def test_greedy_takes_the_longest_matching_prefix() -> None:
    # Two requests, D = 3: the target picks 1, 2, 3, 4 on the rows of each.
    logits = one_hot_logits([1, 2, 3, 4, 1, 2, 3, 4])
    drafts = torch.tensor([[1, 2, 0], [1, 5, 3]])  # 2 match, then 1 (a later match is no use)
    y, a = verify(logits, drafts)
    assert y.tolist() == [[1, 2, 3, 4]] * 2 and a.tolist() == [2, 1]
    # All accepted: the bonus row's token follows; no draft (-1) is never accepted.
    y, a = verify(logits, torch.tensor([[1, 2, 3], [-1, 2, 3]]))
    assert a.tolist() == [3, 0]


def test_greedy_rows_of_a_sampled_batch_stay_greedy() -> None:
    logits = one_hot_logits([1, 2, 3, 4])
    temps = torch.tensor([0.0, 0.0, 1.0, 1.0])
    keys = torch.tensor([token_key(1, i) for i in range(4)])
    y, a = verify(logits, torch.tensor([[1], [0]]), temps, keys)
    assert y[0].tolist() == [1, 2] and a[0] == 1


def test_sampling_keeps_the_target_distribution() -> None:
    """Row 0 of many requests checks draft d against p = softmax(logits / T): the token it
    yields must follow p (and the draft be taken with probability p(d))."""
    n, T, d = 20000, 0.7, 2
    base = torch.tensor([0.3, -0.2, 1.1, 0.4, -1.0, 0.8])
    p = torch.softmax(base / T, dim=0)
    logits = base.repeat(2 * n, 1)  # rows 0 and 1 of each request (D = 1)
    keys = torch.tensor([token_key(s, i) for s in range(n) for i in (0, 1)])
    temps = torch.full((2 * n,), T)
    y, a = verify(logits, torch.full((n, 1), d), temps, keys)
    freq = torch.bincount(y[:, 0], minlength=6).float() / n
    assert (freq - p).abs().max() < 0.012, (freq, p)  # ~4 standard deviations
    assert abs(a.float().mean() - p[d]) < 0.012
    # A rejected draft is never the token yielded instead of it.
    assert not ((a == 0) & (y[:, 0] == d)).any()


def test_row_keys_follow_the_position_of_the_token_yielded() -> None:
    """A verify row's key is its request's stream key derived with the position of the token
    it yields: the same whichever step yields it (overlapped steps know positions only on the
    device), distinct per row and per request."""
    stream = torch.tensor([stream_key(7)] * 3 + [stream_key(8)] * 3)
    keys = row_keys(stream, torch.tensor([10, 10], dtype=torch.int32), 3)
    assert keys[:3].tolist() == derive(stream[:3], torch.tensor([11, 12, 13])).tolist()
    assert row_keys(stream[:2], torch.tensor([11], dtype=torch.int32), 2)[0] == keys[1]
    assert len(set(keys.tolist())) == 6


def _tiny_model(device: str, slots: int):
    """The tiny preset with an MTP layer on a baseline backend, `slots` requests of 20
    synthetic tokens each."""
    cfg = preset("tiny", mtp_layers=1)
    weights = random_weights(cfg, seed=1, device=device)
    kernels = KernelSet.reference() if device == "cpu" else KernelSet.triton()
    lay = baseline_layout(cfg.kv_layers, 4, 64, cfg.topk)
    be = BaselineBackend(lay, kernels=kernels, device=device)
    for slot in range(slots):
        be.fill_synthetic(slot, 20, seed=slot, chunk=16)
    return Model(cfg, weights, be)


def test_device_positions_follow_the_accepted_count() -> None:
    """A verify step staged with positions -1 starts where each slot's last step left it
    (its first position + accepted + 1, moved on by the draft step): the same logits as the
    step staged with those positions, which `staged` reports."""
    D, n, slots = 2, 3, [0, 1, 2]
    known, device = (
        SpeculativeModelRunner(_tiny_model("cpu", n), DecodeConfig(max_batch=4), D)
        for _ in range(2)
    )
    for r in (known, device):
        for s in slots:
            r.drafts[s] = torch.tensor([9 + s, 4])
    pos, ids, accepted = [20] * n, [5, 6, 7], torch.tensor([0, 1, 2])
    for step in range(3):
        want = known.step(ids, pos, slots).clone()
        got = device.step(ids, pos if step == 0 else [-1] * n, slots)
        assert torch.equal(got, want), step
        assert device.staged(n)[1].tolist() == pos
        y = want.view(n, D + 1, -1).argmax(-1)
        known.draft(y, accepted)
        device.draft(y, accepted)
        pos, ids = [p + int(a) + 1 for p, a in zip(pos, accepted)], [-1] * n


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_verify_rows_score_like_plain_decode_rows(device) -> None:
    """The verify rows of a step (D = 2, three requests: padded buckets either way) against
    plain decode steps at the same positions with the same tokens: the same argmax always, and
    on CPU (torch's GEMMs here, measured) the same bits. A GPU GEMM may round a row differently
    with 3 (D + 1) rows than with 3, so there only the tokens and a small difference are
    asserted; the engine tests compare tokens for that reason."""
    D, n, steps = 2, 3, 4
    slots, tokens, plain = list(range(n)), [[5 + s] for s in range(n)], []
    runner = ModelRunner(_tiny_model(device, n), DecodeConfig(max_batch=4))
    for i in range(steps * (D + 1)):
        pos = [20 + i] * n
        plain.append(runner.step([t[-1] for t in tokens], pos, slots, [p + 1 for p in pos]).clone())
        for s in slots:
            tokens[s].append(int(plain[-1][s].argmax()))
    spec = SpeculativeModelRunner(_tiny_model(device, n), DecodeConfig(max_batch=4), D)
    for step in range(steps):
        i = step * (D + 1)
        for s in slots:
            spec.drafts[s] = torch.tensor(tokens[s][i + 1 : i + 1 + D], device=device)
        rows = spec.step([tokens[s][i] for s in slots], [20 + i] * n, slots).view(n, D + 1, -1)
        for j in range(D + 1):
            assert torch.equal(rows[:, j].argmax(-1), plain[i + j].argmax(-1)), (step, j)
            if device == "cpu":
                assert torch.equal(rows[:, j], plain[i + j]), (step, j)
            else:
                assert (rows[:, j] - plain[i + j]).abs().max() < 0.05, (step, j)
        y = rows.argmax(-1)
        spec.draft(y, torch.full((n,), D, dtype=torch.int64, device=device))


def test_speculative_configuration_is_checked(tmp_path) -> None:
    """Draft tokens 1..3; a layout whose LRU slots cannot hold the verify rows' union is
    refused at attach, naming both numbers; with --speculative mtp the service's layout must
    hold the model's layers and the MTP layer's (checked, not adopted); a checkpoint must hold
    the MTP layer (V3.2's layer num_layers)."""
    import asyncio

    from contract.errors import LayoutMismatch
    from engine_client.model.weights import checkpoint_layers, load_safetensors, save_safetensors
    from engine_client.serve.factory import build_engine, load_vocabulary, model_config
    from tests.process_harness import LOCAL, engine_config

    for bad in (dict(draft_tokens=4), dict(draft_tokens=0)):
        with pytest.raises(ValueError):
            setting_groups.replace(engine_config("embedded"), speculative="mtp", **bad)
    # B - W = 24 < k (D + 1) = 16 * 4.
    cfg = setting_groups.replace(engine_config("embedded"), speculative="mtp", draft_tokens=3)
    with pytest.raises(LayoutMismatch, match=r"16 \* 4 = 64 vs B - W = 32 - 8 = 24"):
        asyncio.run(build_engine(cfg))
    spec = setting_groups.replace(cfg, draft_tokens=1)
    vocab = load_vocabulary(spec)
    assert model_config(spec, vocab, LOCAL.layout(3, 16)).num_layers == 2
    with pytest.raises(LayoutMismatch, match="2 decoder layers \\+ 1 MTP layer = 3 layers"):
        model_config(spec, vocab, LOCAL.layout(2, 16))
    mcfg = preset("tiny", mtp_layers=1)
    weights = random_weights(mcfg)
    save_safetensors(weights, tmp_path / "mtp.safetensors")
    assert checkpoint_layers(tmp_path / "mtp.safetensors") == 3
    assert load_safetensors(tmp_path / "mtp.safetensors", mcfg).keys() == weights.keys()
    save_safetensors(random_weights(preset("tiny")), tmp_path / "plain.safetensors")
    with pytest.raises(ValueError, match="model.layers.2."):
        load_safetensors(tmp_path / "plain.safetensors", mcfg)
