"""Prefix caching on the engine's side: the names of a request's full pages
(`contract.prefix.page_hashes`) that its admission looks up and its release publishes. The KV
side (kv_service/books/ledger.py) maps the cached pages and scopes the names by namespace."""

from __future__ import annotations

from dataclasses import dataclass

from contract.prefix import page_hashes
from engine_client.client.control import PrefixLookup
from engine_client.loop.control_ref import ControlRef
from engine_client.loop.request import Finish, GenRequest
from engine_client.loop.synthetic import SyntheticContext


@dataclass(frozen=True)
class PrefixReuse:
    """The engine's prefix caching (serve's PrefixCaching settings): `enabled` off
    (--prefix-cache 0): nothing is named; `share_generated` off: only prompt pages are (see
    PageNames.release); `pages`: reuse to the page instead of the prefill chunk."""

    enabled: bool = False
    share_generated: bool = True
    pages: bool = False


class PageNames:
    """What the scheduler tells the KV side about a request's pages, as `reuse` says."""

    def __init__(
        self,
        control: ControlRef,
        synthetic: SyntheticContext,
        prefill_chunk: int,
        reuse: PrefixReuse = PrefixReuse(),
    ) -> None:
        self.control, self.synthetic, self.prefill_chunk = control, synthetic, prefill_chunk
        self.reuse = reuse

    def lookup(self, req: GenRequest) -> PrefixLookup | None:
        """The prompt's page names, salt, and the reuse granularity: the prefill chunk, or (with
        reuse.pages) the page alone (align 0: the KV side rounds to pages anyway)."""
        if not self.reuse.enabled:
            return None
        if req.prompt_hashes is None:
            named = req.prompt[: self.synthetic.shared] if self.synthetic.tokens else req.prompt
            req.prompt_hashes = tuple(page_hashes(named, self.control.current.layout.page_size))
        if not req.prompt_hashes:
            return None
        # A synthetic shared context is reused whole or not at all (it is filled in one go).
        if self.synthetic.tokens:
            align = self.synthetic.shared
        else:
            align = 0 if self.reuse.pages else self.prefill_chunk
        return PrefixLookup(req.prompt_hashes, req.cache_salt, align)

    def release(self, req: GenRequest) -> tuple[bytes, ...]:
        """Names of the full pages of a finished request's tokens (prompt, then generated), so
        the KV side can share its written pages with the conversation's next turn. None after
        a failed step: its KV is undefined. None either without share_generated: a decode step
        writes its rows in other shapes than a prefill (batched GEMMs, split attention), so on
        a GPU they may differ in the last bits from the rows a cold prefill would write."""
        if (
            not self.reuse.enabled
            or not self.reuse.share_generated
            or self.synthetic.tokens  # only a synthetic context's shared part is named
            or req.finish is Finish.ERROR
        ):
            return ()
        tokens = req.prompt + tuple(req.tokens)
        return tuple(page_hashes(tokens, self.control.current.layout.page_size))
