"""The layout of the KV memory the engine allocates itself in baseline and embedded modes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from contract.flags import setting
from contract.layout import KVLayout


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
    shared_slots: int = setting(0, help="embedded: " + _layout_help("shared_slots"))
    host_reads: bool = setting(False, help="embedded: " + _layout_help("host_reads"))

    def __post_init__(self) -> None:
        self.layout(num_layers=1, topk=max(1, self.hot_slots - self.window))

    def layout(self, num_layers: int, topk: int) -> KVLayout:
        return KVLayout(num_layers=num_layers, topk=topk, **dataclasses.asdict(self))
