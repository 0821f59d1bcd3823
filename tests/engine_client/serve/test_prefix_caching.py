"""PrefixCaching.reuse_to_pages: page reuse is the default, and --prefix-share-generated 0 (every
reuse bitwise a cold prefill) keeps chunk reuse on a GPU unless the kernels are batch-invariant."""

from __future__ import annotations

import pytest

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
    assert prefix.reuse_to_pages(device, batch_invariant) is pages


def test_page_reuse_is_the_default() -> None:
    assert PrefixCaching().reuse_to_pages("cuda:0", batch_invariant=False)
