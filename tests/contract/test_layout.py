import pytest
import torch

from contract.layout import MODE_OFFLOADED, MODE_RESIDENT, KVLayout, LayoutError
from contract.tensors import tensor_specs
from kv_service.memory.store import allocate_local, free_request, reset_request


def small(**kw) -> KVLayout:
    base = dict(
        num_layers=2,
        max_requests=3,
        hot_slots=24,
        window=3,
        topk=13,
        page_size=5,
        num_pages=40,
        max_context=97,
    )
    base.update(kw)
    return KVLayout(**base)


@pytest.mark.parametrize(
    "field,value",
    [
        ("num_layers", 0),
        ("max_requests", -1),
        ("page_size", 0),
        ("window", 0),
        ("row_format", "fp16"),
        ("index_format", "int4"),
        ("version", 99),
    ],
)
def test_invalid_layouts_are_refused(field, value):
    with pytest.raises(LayoutError):
        small(**{field: value})


def test_window_and_topk_must_fit_the_hot_buffer():
    with pytest.raises(LayoutError, match="victim"):
        small(hot_slots=15, window=3, topk=13)
    assert small(hot_slots=16, window=3, topk=13).lru_slots == 13


def test_derived_sizes():
    lay = small(row_format="fp8", index_format="fp8")
    assert lay.row_bytes == 656 and lay.index_bytes == 132
    assert lay.max_pages_per_request == 20  # ceil(97 / 5)
    assert lay.pages_for(11) == 3
    assert lay.host_tier_bytes == 40 * 2 * 5 * 656
    specs = tensor_specs(lay)
    assert specs["host_kv"][0] == (40, 2, 5, 656)
    assert specs["lru_order"][0] == (2, 3, 21)


def test_dict_round_trip_and_mismatch_report():
    lay = small()
    assert KVLayout.from_dict(lay.to_dict()) == lay
    with pytest.raises(LayoutError, match="hot_slots"):
        lay.check_matches(small(hot_slots=30))


def test_reset_and_free_request():
    lay = small()
    kv = allocate_local(lay)
    kv.token_slot[:, 1].fill_(7)
    kv.slot_token[:, 1].fill_(7)
    kv.lru_order[:, 1].fill_(0)
    reset_request(kv, 1, MODE_OFFLOADED, [4, 9, 2])
    assert kv.page_table[1, :3].tolist() == [4, 9, 2]
    assert (kv.page_table[1, 3:] == -1).all()
    assert (kv.token_slot[:, 1] == -1).all() and (kv.slot_token[:, 1] == -1).all()
    assert kv.lru_order[0, 1].tolist() == list(range(3, 24))
    assert kv.req_mode[1] == MODE_OFFLOADED and kv.req_mode[0] == 0
    free_request(kv, 1)
    assert kv.req_mode[1] == 0 and (kv.page_table[1] == -1).all()
    with pytest.raises(ValueError):
        reset_request(kv, 0, MODE_RESIDENT, list(range(21)))


def test_tensors_refuse_wrong_shapes():
    lay = small()
    kv = allocate_local(lay)
    fields = {n: getattr(kv, n) for n in tensor_specs(lay)}
    fields["hit_flag"] = torch.zeros((3, 25), dtype=torch.int8)
    with pytest.raises(ValueError, match="hit_flag"):
        type(kv)(layout=lay, **fields)


def test_draft_tokens_need_the_union_and_the_ring_to_fit():
    """A verify step's D + 1 rows share one plan: k (D + 1) <= B - W and W >= D + 1."""
    lay = small(topk=8)  # B 24, W 3, k 8: 8 * 2 = 16 <= 21, 8 * 3 = 24 > 21
    assert "k * (D + 1) = 16 <= B - W = 21" in lay.check_draft_tokens(1)
    assert lay.fits_draft_tokens(0) and lay.fits_draft_tokens(1)
    with pytest.raises(LayoutError, match="k \\* \\(D \\+ 1\\) <= B - W"):
        lay.check_draft_tokens(2)
    assert not small(topk=8, window=1).fits_draft_tokens(1)  # the ring holds one row's token
    assert small(topk=8, hot_slots=40, window=4).fits_draft_tokens(3)
    assert not small(topk=8, hot_slots=40, window=4).fits_draft_tokens(4)  # > MAX_DRAFT_TOKENS


def test_host_reads_let_the_lru_slots_fall_below_topk():
    """With host_reads the misses past the victims are read from the host tier, so the rule
    becomes one LRU slot at least, and the host tier's rows must fit an int32 slot entry."""
    lay = small(hot_slots=9, window=3, topk=13, host_reads=True)
    assert lay.lru_slots == 6
    with pytest.raises(LayoutError, match="exceed window"):
        small(hot_slots=3, window=3, topk=13, host_reads=True)
    # 2^31 - 2 rows at most: -2 - row must stay an int32
    with pytest.raises(LayoutError, match="2\\^31 - 2"):
        small(hot_slots=9, host_reads=True, num_pages=2**30, page_size=1, num_layers=2)
    assert small(hot_slots=9, host_reads=True, num_pages=2**30 - 1, page_size=1, num_layers=2)
    # the same sizes without host_reads: refused, and the message names the switch
    with pytest.raises(LayoutError, match="host_reads"):
        small(hot_slots=9, window=3, topk=13)


def test_host_reads_relax_the_draft_union_but_not_the_ring():
    lay = small(topk=8, host_reads=True)  # B 24, W 3: 8 * 3 = 24 > 21, read from the host
    assert "host reads for the rest" in lay.check_draft_tokens(2)
    assert not lay.fits_draft_tokens(3)  # W 3 < D + 1: the ring still decides
    assert small(topk=8, window=4, host_reads=True).fits_draft_tokens(3)
    assert not small(topk=8, window=1, host_reads=True).fits_draft_tokens(1)
    # with a shared region the plan's scratch holds max(B - W, k) entries a request
    region = small(topk=8, host_reads=True, shared_slots=24)
    assert region.fits_draft_tokens(0) and region.fits_draft_tokens(1)  # 16 <= 21
    with pytest.raises(LayoutError, match="shared region"):
        region.check_draft_tokens(2)


def test_host_reads_cross_the_wire():
    from contract.codec import layout_from_proto, layout_to_proto

    lay = small(hot_slots=9, host_reads=True)
    assert layout_from_proto(layout_to_proto(lay)) == lay
    assert layout_from_proto(layout_to_proto(small())).host_reads is False
