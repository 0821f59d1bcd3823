"""PrefixCaching.reuse, the one place the engine's PrefixReuse is made: page reuse is the default,
and --prefix-share-generated 0 (every reuse bitwise a cold prefill) keeps chunk reuse on a GPU
unless the kernels are batch-invariant; the other two settings pass through."""

from __future__ import annotations

import pytest

from engine_client.loop.page_names import PrefixReuse
from engine_client.serve.settings.prefix_caching import PrefixCaching


@pytest.mark.parametrize(
    "reuse_pages,share_generated,device,batch_invariant,pages",
    [
        (True, True, "cuda:0", False, True),  # the defaults on a GPU
        (True, True, "cpu", False, True),
        (True, False, "cpu", False, True),  # CPU prefill rows do not depend on the chunk
        (True, False, "cuda:0", False, False),  # bitwise-cold promised: chunk reuse
        (True, False, "cuda:0", True, True),  # ... which batch-invariant kernels keep
        (False, True, "cuda:0", True, False),
        (False, True, "cpu", False, False),
    ],
)
def test_reuse_goes_to_the_page_unless_a_cold_prefills_bits_are_promised(
    reuse_pages, share_generated, device, batch_invariant, pages
) -> None:
    prefix = PrefixCaching(prefix_reuse_pages=reuse_pages, prefix_share_generated=share_generated)
    assert prefix.reuse(device, batch_invariant) == PrefixReuse(True, share_generated, pages)


def test_page_reuse_is_the_default() -> None:
    assert PrefixCaching().reuse("cuda:0", batch_invariant=False) == PrefixReuse(True, True, True)


def test_without_the_cache_nothing_is_reused() -> None:
    assert not PrefixCaching(prefix_cache=False).reuse("cpu", batch_invariant=False).enabled
