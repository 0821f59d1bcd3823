"""The benchmarks' hooks into the engine (bench/e2e/): a synthetic context filled by
KVBackend.fill_synthetic instead of a prefill, and a top-k source factory "MODULE:FUNC[:JSON
kwargs]" in place of the model's indexer."""

from __future__ import annotations

from dataclasses import dataclass

from contract.flags import setting
from contract.rules import at_least, check_settings, plugin_or


@dataclass(frozen=True)
class BenchmarkHooks:
    synthetic_context: int = setting(
        0,
        help="benchmarks: prefix every prompt with this many "
        "synthetic context tokens, filled with random KV instead "
        "of a prefill",
        check=at_least(0),
    )
    synthetic_shared: int = setting(
        0,
        check=at_least(0),
        help="benchmarks: the first N tokens of the synthetic context are the same for every "
        "request (shared by prefix caching), the rest differ per request",
    )
    topk_source: str = setting(
        "indexer",
        help="benchmarks: decode top-k from the model's "
        "indexer, or from MODULE:FUNC[:JSON] (e.g. bench.shared.trace:trace_source)",
        check=plugin_or("indexer"),
    )

    def __post_init__(self) -> None:
        check_settings(self)
        if self.synthetic_shared > self.synthetic_context:
            raise ValueError(
                f"synthetic_shared must be in [0, synthetic_context], got {self.synthetic_shared}"
            )
