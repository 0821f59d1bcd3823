"""A prefill engine's PrefillService (serve.prefill_servicer) over real gRPC, with a fake engine
and export (no nixl, no model): past its batch it refuses at once with a typed capacity error
(the decode side's router passes it over), and when the decode side goes away mid-prefill (its
channel closed, as when it is killed) gRPC cancels the handler, which cancels the request and
drops its export at once (nothing waits for EXPORT_TIMEOUT)."""

from __future__ import annotations

import asyncio
import os
import shutil

import grpc

from contract.codec import target_to_proto
from contract.errors import CapacityError
from contract.transfer_target import ROWS, Region, TransferTarget
from engine_client.client.prefill_peer import PrefillPeer
from engine_client.loop.request import GenRequest, Phase
from engine_client.serve.interceptor import EngineInterceptor
from engine_client.serve.prefill_servicer import PrefillServicer
from proto.prefill.v1 import prefill_pb2_grpc
from tests.process_harness import layout_with
from tests.service_harness import short_tmpdir

TARGET = target_to_proto(
    TransferTarget("decode-1", b"meta", (Region(ROWS, 0, 1 << 20, 1 << 10, 1 << 8),), layout_with())
)


class Api:
    """Submits requests that never finish (a long prefill); records cancels."""

    def __init__(self) -> None:
        self.submitted: list[GenRequest] = []
        self.cancelled = asyncio.Event()

    def submit(self, prompt, max_new_tokens, sampling) -> GenRequest:
        req = GenRequest(f"p{len(self.submitted)}", prompt, max_new_tokens, sampling)
        self.submitted.append(req)
        return req

    def cancel(self, req: GenRequest) -> None:
        req.phase = Phase.FINISHED
        self.cancelled.set()


class Export:
    def __init__(self) -> None:
        self.expected: list[tuple] = []
        self.dropped: list[str] = []

    def expect(self, request_id, target, pages, tokens) -> asyncio.Future[int]:
        self.expected.append((request_id, tuple(pages), tokens))
        return asyncio.get_running_loop().create_future()

    def drop(self, request_id: str, caller_gone: bool = False) -> None:
        self.dropped.append((request_id, caller_gone))


async def _scenario(servicer: PrefillServicer, target: str) -> None:
    api, export = Api(), Export()
    servicer.engine, servicer.export = _Engine(api), export  # type: ignore[assignment]
    leaving = PrefillPeer(target, timeout=60)
    first = asyncio.create_task(leaving.prefill("d1", [5, 6, 7], (0.0, 0), TARGET, [2, 3], 0))
    while not api.submitted:
        await asyncio.sleep(0.01)
    assert export.expected == [("p0", (2, 3), (0, 3))]
    other = PrefillPeer(target, timeout=60)
    try:
        await other.prefill("d2", [5], (0.0, 0), TARGET, [4], 0)
        raise AssertionError("a second prompt past a batch of one was taken")
    except CapacityError as e:
        assert not e.permanent  # full for now: another peer, or this one later
    finally:
        await other.close()
    await leaving.close()  # the decode side goes away mid-prefill
    await asyncio.wait_for(api.cancelled.wait(), 30)
    assert export.dropped == [("p0", True)] and servicer.busy == 0
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)


class _Engine:
    def __init__(self, api: Api) -> None:
        self.api = api


def test_full_refuses_and_a_gone_caller_drops_the_prefill() -> None:
    async def go() -> None:
        path = os.path.join(short_tmpdir("hsp"), "p.sock")
        server = grpc.aio.server(interceptors=[EngineInterceptor(None)])
        servicer = PrefillServicer(limit=1)
        prefill_pb2_grpc.add_PrefillServiceServicer_to_server(servicer, server)
        server.add_insecure_port(f"unix:{path}")
        await server.start()
        try:
            await _scenario(servicer, f"unix:{path}")
        finally:
            await server.stop(None)
            shutil.rmtree(os.path.dirname(path), ignore_errors=True)

    asyncio.run(go())
