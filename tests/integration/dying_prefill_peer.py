"""A prefill peer that dies mid-transfer, for tests/integration/test_disaggregation_faults.py:
it serves prefill.v1.PrefillService, and on its first call writes garbage over NIXL into the
first half of the decode side's uncached prompt pages (rows: a transfer cut short), then exits
at once, as a killed process does (no reply, no clean-up).

    python -m tests.integration.dying_prefill_peer SOCKET
"""

from __future__ import annotations

import asyncio
import os
import sys

import torch
from grpc_health.v1.health import aio as health_aio

from contract.codec import target_from_proto
from contract.nixl_agent import NixlAgent
from contract.transfer_target import ROWS, Span
from proto.prefill.v1 import prefill_pb2 as pb
from proto.prefill.v1 import prefill_pb2_grpc as pb_grpc
from transport import grpc_server

SERVICE_NAME = "decode.v1.DecodeService"  # the health name the test harness waits on
KILLED = 137  # the exit status of a SIGKILLed process


class Dying(pb_grpc.PrefillServiceServicer):
    async def Prefill(self, request: pb.PrefillRequest, context) -> pb.PrefillResponse:
        target = target_from_proto(request.target)
        lay, dst = target.layout, target.region(ROWS)
        page_bytes = lay.page_size * lay.row_bytes
        garbage = torch.randint(0, 256, (page_bytes,), dtype=torch.uint8)
        agent = NixlAgent(f"dying-{os.getpid()}")
        agent.register(ROWS, garbage, page_bytes, page_bytes)
        first = request.cached_tokens // lay.page_size
        used = -(-len(request.prompt) // lay.page_size)
        pages = request.pages[first : first + max(1, (used - first) // 2)]
        spans = [
            Span(0, dst.at(layer, page), page_bytes)
            for layer in range(lay.num_layers)
            for page in pages
        ]
        agent.write(target, [(ROWS, spans)])
        sys.stdout.write(f"wrote garbage into pages {list(pages)}; dying\n")
        sys.stdout.flush()
        os._exit(KILLED)


async def main(path: str) -> None:
    health = health_aio.HealthServicer()
    server = grpc_server.scaffold(SERVICE_NAME, health, [])
    pb_grpc.add_PrefillServiceServicer_to_server(Dying(), server)
    server.add_insecure_port(f"unix:{path}")
    await server.start()
    await grpc_server.set_health(health, SERVICE_NAME, True)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
