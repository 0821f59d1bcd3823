"""One origin for the layout: in service modes the engine adopts the layers, top-k and row and
index formats of the service's Attach reply, and refuses, naming both values, a model that
cannot take them (real `python -m kv_service`, engine built in-process)."""

from __future__ import annotations

import asyncio

import pytest

from contract.errors import LayoutMismatch
from engine_client.loop.request import SamplingParams
from engine_client.model.preset import preset
from engine_client.model.weights import random_weights, save_safetensors
from engine_client.serve.factory import build_engine
from kernels.formats import FP8_KEYS, FP8_ROW
from tests.process_harness import engine_config, layout_with, service_stats, start_service, workdir

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

# Not the tiny preset's 2 layers and top-k 16, nor the engine's local bf16 formats.
SERVICE = layout_with(num_layers=3, topk=12, row_format="fp8", index_format="fp8")


@pytest.fixture(scope="module")
def service():
    with workdir() as path:
        svc = start_service(path, SERVICE)
        try:
            yield svc, path
        finally:
            assert svc.stop() == 0, svc.log()


async def first_tokens(cfg) -> tuple[list[int], tuple]:
    engine = await build_engine(cfg)
    try:
        model, layout = engine.compute.model, engine.compute.layout
        shape = (model.cfg.num_layers, model.cfg.topk, layout.row, layout.index)
        req = engine.api.submit(tuple(range(3, 30)), 3, SamplingParams())
        engine.start()
        async for _ in req.follow():
            pass
        return req.tokens, shape
    finally:
        await engine.stop()


def test_the_engine_adopts_the_services_layout(service) -> None:
    svc, _ = service
    tokens, shape = asyncio.run(first_tokens(engine_config("service", svc)))
    assert shape == (3, 12, FP8_ROW, FP8_KEYS)
    assert len(tokens) == 3
    assert service_stats(svc).requests == 0


async def refused(cfg) -> str:
    with pytest.raises(LayoutMismatch) as e:
        await build_engine(cfg)
    return str(e.value)


def test_an_engine_told_other_layers_is_refused_naming_both(service) -> None:
    svc, _ = service
    msg = asyncio.run(refused(engine_config("service", svc, num_layers=2)))
    assert "--num-layers 2" in msg and "3 layers" in msg, msg


def test_a_checkpoint_with_fewer_layers_is_refused_naming_both(service) -> None:
    svc, path = service
    ckpt = f"{path}/two-layers.safetensors"
    save_safetensors(random_weights(preset("tiny"), seed=1), ckpt)
    msg = asyncio.run(refused(engine_config("service", svc, checkpoint=ckpt)))
    assert "holds 2 layers" in msg and "has 3 layers" in msg, msg
