"""The engine's configuration: one frozen dataclass built once in __main__ from flags and passed
down explicitly. It composes the setting groups of `engine_client.serve.settings`, each of which
owns its settings (a flag of `serve` whose default comes from an ENGINE_* environment variable,
contract.flags; nested groups' flags are flat) and their rules, and holds the rules that tie
groups together. Tests and benchmarks build one by its settings' names with
`contract.setting_groups`."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine_client.serve.settings.batching import Batching
from engine_client.serve.settings.benchmark_hooks import BenchmarkHooks
from engine_client.serve.settings.disaggregation import Disaggregation
from engine_client.serve.settings.endpoints import Endpoints
from engine_client.serve.settings.execution import Execution
from engine_client.serve.settings.kv_access import KVAccess
from engine_client.serve.settings.local_layout import LocalLayout
from engine_client.serve.settings.model_source import ModelSource
from engine_client.serve.settings.observability import Observability
from engine_client.serve.settings.prefix_caching import PrefixCaching
from engine_client.serve.settings.queueing import Queueing
from engine_client.serve.settings.speculation import Speculation


@dataclass(frozen=True)
class EngineConfig:
    """Everything `python -m engine_client serve` can be told, by group (`--help` lists each
    setting). `endpoints` and `kv` have no default: an engine needs somewhere to listen and a
    place for its KV, and their defaults come from the command line's (socket paths)."""

    endpoints: Endpoints
    kv: KVAccess
    disaggregation: Disaggregation = field(default_factory=Disaggregation)
    model: ModelSource = field(default_factory=ModelSource)
    execution: Execution = field(default_factory=Execution)
    local: LocalLayout = field(default_factory=LocalLayout)
    batching: Batching = field(default_factory=Batching)
    queueing: Queueing = field(default_factory=Queueing)
    prefix: PrefixCaching = field(default_factory=PrefixCaching)
    speculation: Speculation = field(default_factory=Speculation)
    benchmark: BenchmarkHooks = field(default_factory=BenchmarkHooks)
    observability: Observability = field(default_factory=Observability)

    def __post_init__(self) -> None:
        role, mode = self.disaggregation.role, self.kv.kv_mode
        if role == "decode" and not (mode == "service" and self.disaggregation.prefill_peer):
            raise ValueError("--role decode needs --kv-mode service and --prefill-peer")
        if self.local.shared_slots and mode != "embedded":
            raise ValueError(
                "--shared-slots sizes embedded mode's own memory; in service modes the "
                "service's layout has it (python -m kv_service --shared-slots), and baseline "
                "mode has no hot buffers"
            )
        if self.local.host_reads and mode != "embedded":
            raise ValueError(
                "--host-reads sizes embedded mode's own memory; in service modes the service's "
                "layout has it (python -m kv_service --host-reads), and baseline mode reads "
                "nothing from a host tier"
            )
        if role == "prefill" and mode != "baseline":
            raise ValueError("--role prefill computes prompts in its own cache: --kv-mode baseline")
