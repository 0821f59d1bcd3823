"""The service's side of prefill/decode disaggregation (--nixl): a NIXL agent that registered
the host tier and the index-key pool, so that a prefill engine writes a request's prompt KV
straight into its pages (`contract.transfer_target` has the page geometry; the agent is
`contract.nixl_agent`'s). On a GPU the index keys land in a host mirror of the pool
(`index_landing`), not in device memory. The agent is named after the instance and the epoch:
a restarted service is a new peer, and nobody writes into the memory of the one before."""

from __future__ import annotations

from contract.nixl_agent import NixlAgent
from contract.tensors import KVTensors
from contract.transfer_target import INDEX, ROWS
from kv_service.memory.index_landing import IndexLanding


def kv_agent(instance: str, epoch: int, kv: KVTensors) -> tuple[NixlAgent, IndexLanding | None]:
    """An agent with the rows of the host tier ([N, L, P, D]: page-major) and the index-key
    pool ([L, N, P, I]: layer-major) registered; on a GPU, in the pool's place, a pinned host
    mirror of it (returned: the ledger empties it into the pool as each request lands)."""
    agent, landing = NixlAgent(f"{instance}-{epoch:x}"), None
    try:
        rows, index = kv.host_kv, kv.index_pool
        if index.is_cuda:
            landing = IndexLanding(index)
            index = landing.mirror
        agent.register(ROWS, rows, layer_stride=rows.stride(1), page_stride=rows.stride(0))
        agent.register(INDEX, index, layer_stride=index.stride(0), page_stride=index.stride(1))
    except BaseException:
        agent.close()
        raise
    return agent, landing
