"""The kvcache.v1 replies built from the core's records: a request's state, an admission, the
stats. Beside the servicer, which only translates calls."""

from __future__ import annotations

from kv_service.core import CoreStats, RequestRecord, ServiceCore
from proto.kvcache.v1 import kvcache_pb2 as pb

UINT64_MAX = 2**64 - 1


def u64(value: int) -> int:
    """A total for a uint64 field: totals are unbounded Python ints, the field is not, and
    GetStats must never fail for a number."""
    return min(max(int(value), 0), UINT64_MAX)


def request_to_proto(r: RequestRecord) -> pb.RequestState:
    return pb.RequestState(
        request_id=r.request_id,
        slot=r.slot,
        mode=pb.ResidencyMode.ValueType(r.mode),
        seq_len=r.seq_len,
        reserved_tokens=r.reserved_tokens,
        prompt_len=r.prompt_len,
        max_new_tokens=r.max_new_tokens,
        cached_tokens=r.cached_tokens,
    )


def admitted(core: ServiceCore, sid: str, a: pb.Admit) -> pb.Admitted:
    """The one session message with an answer: the admission, as the engine adopts it."""
    r = core.admit(
        sid,
        a.request_id,
        a.prompt_len,
        a.max_new_tokens,
        a.page_hashes,
        a.cache_salt,
        a.reuse_align,
    )
    return pb.Admitted(
        request_id=r.request_id,
        slot=r.slot,
        mode=pb.ResidencyMode.ValueType(r.mode),
        pages=r.pages,
        reserved_tokens=r.reserved_tokens,
        cached_tokens=r.cached_tokens,
    )


def stats_to_proto(s: CoreStats) -> pb.GetStatsResponse:
    return pb.GetStatsResponse(
        host_pages=pb.PoolUsage(used=s.pages_used, total=s.pages_total),
        request_slots=pb.PoolUsage(used=s.slots_used, total=s.slots_total),
        sessions=s.sessions,
        requests=s.requests,
        hits=u64(s.hits),
        misses=u64(s.misses),
        bytes_moved=u64(s.bytes_moved),
        uptime_seconds=s.uptime_seconds,
        epoch=u64(s.epoch),
        draining=s.draining,
        admitted_total=u64(s.admitted_total),
        rejected_total=u64(s.rejected_total),
        expired_sessions_total=u64(s.expired_sessions_total),
        cached_pages=s.cached_pages,
        evictable_pages=s.evictable_pages,
        prefix_lookups_total=u64(s.prefix_lookups_total),
        prefix_lookup_tokens_total=u64(s.prefix_lookup_tokens_total),
        prefix_hit_tokens_total=u64(s.prefix_hit_tokens_total),
        evicted_pages_total=u64(s.evicted_pages_total),
    )
