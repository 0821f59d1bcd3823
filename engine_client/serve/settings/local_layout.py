"""The layout of the KV memory the engine allocates itself in baseline and embedded modes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from contract.flags import setting
from contract.layout import KVLayout, check_shared_slots


def _layout_help(name: str) -> str:
    """The help of KVLayout's field `name`: one description for the service's flag and ours."""
    return next(f.metadata["help"] for f in dataclasses.fields(KVLayout) if f.name == name)


@dataclass(frozen=True)
class LocalLayout:
    """The KV layout the engine allocates itself in baseline and embedded modes: KVLayout's
    fields with the engine's defaults, less the two the model decides (num_layers and topk:
    `layout`). In service modes the service's layout is adopted instead and these are unused.
    Validated as the KVLayout they make (its own checks, for any top-k the hot slots hold)."""

    max_requests: int = setting(8, help="baseline/embedded: " + _layout_help("max_requests"))
    hot_slots: int = setting(64, help="embedded: " + _layout_help("hot_slots"))
    window: int = setting(8, help="embedded: " + _layout_help("window"))
    page_size: int = setting(16, help="baseline/embedded: " + _layout_help("page_size"))
    num_pages: int = setting(256, help="embedded: " + _layout_help("num_pages"))
    max_context: int = setting(512, help="baseline/embedded: " + _layout_help("max_context"))
    index_format: str = setting("bf16", help="baseline/embedded: " + _layout_help("index_format"))
    row_format: str = setting("bf16", help="baseline/embedded: " + _layout_help("row_format"))
    shared_slots: int = setting(
        0,
        help="embedded, reference kernels: hot slots per layer shared by the rows of cached "
        "prefix pages (issue 40; a multiple of hot_slots, taken from the last request slots' "
        "buffers); 0: off",
    )

    def __post_init__(self) -> None:
        lay = self.layout(num_layers=1, topk=max(1, self.hot_slots - self.window))
        if self.shared_slots:
            check_shared_slots(lay, self.shared_slots)

    def layout(self, num_layers: int, topk: int) -> KVLayout:
        fields = dataclasses.asdict(self)
        del fields["shared_slots"]  # the engine's memory, not the layout both sides share
        return KVLayout(num_layers=num_layers, topk=topk, **fields)
