"""The in-process KV controls (`client/local_control.py`): the baseline's bookkeeping over its
own cache and the embedded service core, called directly, raise the contract's typed errors
as a service would."""

from __future__ import annotations

import asyncio

import pytest

from contract import errors
from engine_client.client.control import StepReport
from engine_client.client.local_control import EmbeddedControl
from engine_client.serve.factory import baseline_control
from tests.process_harness import layout_with


def test_baseline_control_capacity_and_release() -> None:
    async def run() -> None:
        ctl = baseline_control(layout_with(max_requests=1), "cpu")
        a = await ctl.admit("a", 4, 4)
        with pytest.raises(errors.CapacityError):
            await ctl.admit("b", 4, 4)
        with pytest.raises(errors.InvalidArgument):
            await ctl.admit("c", 200, 4)
        await ctl.release("a")
        assert (await ctl.admit("b", 4, 4)).slot == a.slot
        with pytest.raises(errors.UnknownRequest):
            await ctl.release("a")

    asyncio.run(run())


def test_embedded_control_maps_core_errors() -> None:
    from kv_service.core import ServiceCore
    from kv_service.memory.store import allocate_local

    async def run() -> None:
        ctl = EmbeddedControl(
            ServiceCore(allocate_local(layout_with(num_pages=4)), lease_seconds=5), "test"
        )
        await ctl.admit("a", 20, 12)
        with pytest.raises(errors.CapacityError) as cap:
            await ctl.admit("b", 8, 8)
        assert cap.value.details["pages_free"] == "0"
        with pytest.raises(errors.UnknownRequest):
            await ctl.commit("zz", 1)
        await ctl.step_end(StepReport(1, (("a", 21),), 3, 1, 1152))
        assert (await ctl.stats()).misses == 1
        await ctl.release("a")
        await ctl.close(detach=True)

    asyncio.run(run())
