"""Prefix caching (kv_service/books/ledger.py, engine_client/loop/scheduler.py): whether the KV
of cached prompt prefixes and finished turns is reused, and the fingerprint that says which
engines may share cached pages."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from contract.flags import setting
from contract.rules import check_settings, text

if TYPE_CHECKING:  # the loop imports torch; `serve --help` must not
    from engine_client.loop.page_names import PrefixReuse


@dataclass(frozen=True)
class PrefixCaching:
    prefix_cache: bool = setting(
        True,
        help="reuse the KV of cached prompt prefixes and of finished turns (full pages shared "
        "read-only; the prefill starts after them); 0: every request prefills all its prompt",
    )
    prefix_share_generated: bool = setting(
        True,
        help="with --prefix-cache: a finished request's generated pages become shareable "
        "(the next turn of a conversation reuses them); 0: only prompt pages are shared, "
        "whose rows a prefill wrote, so every reuse is bitwise a cold prefill on any device",
    )
    prefix_reuse_pages: bool = setting(
        True,
        help="with --prefix-cache: reuse cached prefixes to the page, not to the prefill chunk "
        "(a conversation's next turn prefills only its new pages). A row's bits may then depend "
        "on the chunk it is prefilled in (GEMM shapes): bitwise a cold prefill on CPU, and on a "
        "GPU only where prefill rows do not depend on the chunk (--batch-invariant 1), so on a "
        "GPU without it --prefix-share-generated 0 keeps chunk-aligned reuse; 0: reuse is a "
        "multiple of the prefill chunk, so a prompt's reuse is bitwise a cold prefill",
    )
    model_fingerprint: str = setting(
        "",
        help="names the model and weights; only engines with the same fingerprint share "
        "cached pages; empty: derived from the preset shapes and the weights (seed, or "
        "samples of the checkpoint files)",
        check=text(128),
    )

    def __post_init__(self) -> None:
        check_settings(self)

    def reuse(self, device: str, batch_invariant: bool) -> PrefixReuse:
        """The engine's prefix reuse on `device` ("cpu", "cuda:0"). It goes to the page with
        --prefix-reuse-pages, unless --prefix-share-generated 0 asks every reuse to be bitwise a
        cold prefill where page reuse cannot promise it (a GPU without batch-invariant kernels)."""
        from engine_client.loop.page_names import PrefixReuse

        bitwise_anyway = device.split(":")[0] == "cpu" or batch_invariant
        pages = self.prefix_reuse_pages and (self.prefix_share_generated or bitwise_anyway)
        return PrefixReuse(self.prefix_cache, self.prefix_share_generated, pages)
