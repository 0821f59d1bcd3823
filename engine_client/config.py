"""The engine's configuration: frozen, validated dataclasses built once in __main__ from flags
(each flag's default comes from an ENGINE_* environment variable) and passed down explicitly."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from contract.layout import INDEX_FORMATS, ROW_FORMATS, KVLayout
from engine_client.preset import PRESETS

KV_MODES = ("baseline", "embedded", "service", "service-remote-swap")
DEVICES = ("auto", "cpu", "cuda")
KERNELS = ("auto", "triton", "reference")
MAX_UDS_PATH_BYTES = 107
TCP_RE = re.compile(r"(\[[0-9a-fA-F:]+\]|[\w.-]*):\d{1,5}")


def default_uds(env: dict[str, str], name: str) -> str:
    """$XDG_RUNTIME_DIR is per user and not world-writable, so prefer it over /tmp."""
    return str(Path(env.get("XDG_RUNTIME_DIR") or "/tmp") / name)


def grpc_target(address: str) -> str:
    """A gRPC channel target from a UDS path, a unix: target or HOST:PORT."""
    if address.startswith(("unix:", "dns:", "ipv4:", "ipv6:")):
        return address
    if address.startswith("/") or address.startswith("."):
        return "unix:" + os.path.abspath(address)
    return address


def check_uds(path: str) -> None:
    if len(os.fsencode(path)) > MAX_UDS_PATH_BYTES:
        raise ValueError(f"uds path is longer than {MAX_UDS_PATH_BYTES} bytes: {path}")


@dataclass(frozen=True)
class LocalLayout:
    """Sizes of the KV memory the engine allocates itself in baseline and embedded modes
    (in service modes the service decides and the engine checks what it gets)."""

    max_requests: int = 8
    hot_slots: int = 64
    window: int = 8
    page_size: int = 16
    num_pages: int = 256
    max_context: int = 512
    index_format: str = "bf16"

    def __post_init__(self) -> None:
        for name in ("max_requests", "hot_slots", "window", "page_size", "num_pages", "max_context"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.index_format not in INDEX_FORMATS:
            raise ValueError(f"index_format must be one of {sorted(INDEX_FORMATS)}")

    def layout(self, num_layers: int, topk: int, row_format: str = "bf16") -> KVLayout:
        return KVLayout(num_layers=num_layers, max_requests=self.max_requests,
                        hot_slots=self.hot_slots, window=self.window, topk=topk,
                        page_size=self.page_size, num_pages=self.num_pages,
                        max_context=self.max_context, index_format=self.index_format,
                        row_format=row_format)


@dataclass(frozen=True)
class EngineConfig:
    """Everything `python -m engine_client serve` can be told. See `--help` for each field."""

    kv_mode: str = "baseline"
    uds: str = ""
    tcp: str | None = None
    service: str = ""
    preset: str = "tiny"
    num_layers: int | None = None
    checkpoint: str | None = None
    weight_seed: int = 0
    device: str = "auto"
    kernels: str = "auto"
    cuda_graphs: bool = True
    cpu_threads: int = 1
    max_batch: int = 8
    prefill_chunk: int = 32
    local: LocalLayout = field(default_factory=LocalLayout)
    state_file: str | None = None
    engine_name: str = "engine"
    token: str | None = field(default=None, repr=False)
    rpc_timeout: float = 5.0
    attach_timeout: float = 10.0
    heartbeat_interval: float = 1.0
    admit_retry: float = 0.5
    # Benchmark hooks (bench/e2e.py): every prompt is preceded by this many synthetic context
    # tokens (KVBackend.fill_synthetic instead of a prefill), and decode top-k comes from
    # "indexer" or a source factory "MODULE:FUNC[:JSON kwargs]" (e.g. bench.trace:trace_source).
    synthetic_context: int = 0
    topk_source: str = "indexer"
    # The engine loop (engine_client/engine.py): overlap launches step t + 1 before step t's
    # tokens reach the host; off, every step is waited for (debugging, equality tests).
    overlap: bool = True
    # Queue policy (engine_client/scheduler.py): smaller requests may pass a head refused for
    # capacity for skip_ahead seconds; a request waits at most max_queue_wait (0: no limit).
    skip_ahead: float = 5.0
    max_queue_wait: float = 300.0
    # Prometheus /metrics of the engine; None: not served.
    metrics_port: int | None = None
    metrics_address: str = "127.0.0.1"
    # KV row format ("bf16" / "fp8"); None: the preset's (v32: fp8). Must match the service's.
    row_format: str | None = None
    # embedded/service: decode parts whose miss copy overlaps the other parts' compute on a
    # side stream (HiSparseBackend.microbatches); 1 = off.
    decode_microbatches: int = 1

    def __post_init__(self) -> None:
        if self.kv_mode not in KV_MODES:
            raise ValueError(f"kv_mode must be one of {KV_MODES}, got {self.kv_mode!r}")
        if not self.uds and not self.tcp:
            raise ValueError("the engine needs a uds path or a tcp address to listen on")
        if self.uds:
            check_uds(self.uds)
        if self.tcp is not None and not TCP_RE.fullmatch(self.tcp):
            raise ValueError(f"tcp must be HOST:PORT, got {self.tcp!r}")
        if self.uses_service and not self.service:
            raise ValueError(f"kv_mode {self.kv_mode} needs the service address")
        if self.preset not in PRESETS:
            raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {self.preset!r}")
        if self.num_layers is not None and self.num_layers <= 0:
            raise ValueError(f"num_layers must be positive, got {self.num_layers}")
        if self.checkpoint is not None and not Path(self.checkpoint).exists():
            raise ValueError(f"checkpoint does not exist: {self.checkpoint}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if not 1 <= self.cpu_threads <= 1024:
            raise ValueError(f"cpu_threads must be in 1..1024, got {self.cpu_threads}")
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {KERNELS}, got {self.kernels!r}")
        if not 1 <= self.max_batch <= 4096:
            raise ValueError(f"max_batch must be in 1..4096, got {self.max_batch}")
        if not 1 <= self.prefill_chunk <= 65536:
            raise ValueError(f"prefill_chunk must be in 1..65536, got {self.prefill_chunk}")
        if self.token is not None and (not self.token.isprintable() or " " in self.token
                                       or not self.token):
            raise ValueError("token must be non-empty printable text without spaces")
        for name in ("rpc_timeout", "attach_timeout", "heartbeat_interval", "admit_retry"):
            if not 0 < getattr(self, name) <= 3600:
                raise ValueError(f"{name} must be in (0, 3600] seconds, got {getattr(self, name)}")
        if not self.engine_name or len(self.engine_name) > 128:
            raise ValueError("engine_name must be 1..128 characters")
        if self.synthetic_context < 0:
            raise ValueError(f"synthetic_context must be >= 0, got {self.synthetic_context}")
        for name in ("skip_ahead", "max_queue_wait"):
            if not 0 <= getattr(self, name) <= 86400:
                raise ValueError(f"{name} must be in [0, 86400] seconds, got {getattr(self, name)}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in 0..65535, got {self.metrics_port}")
        if not self.metrics_address:
            raise ValueError("metrics_address must not be empty")
        if self.row_format is not None and self.row_format not in ROW_FORMATS:
            raise ValueError(f"row_format must be one of {sorted(ROW_FORMATS)}, "
                             f"got {self.row_format!r}")
        if not 1 <= self.decode_microbatches <= 64:
            raise ValueError(f"decode_microbatches must be in 1..64, got {self.decode_microbatches}")
        if self.topk_source != "indexer" and ":" not in self.topk_source:
            raise ValueError(f"topk_source must be 'indexer' or MODULE:FUNC, got {self.topk_source!r}")

    @property
    def uses_service(self) -> bool:
        return self.kv_mode in ("service", "service-remote-swap")

    @property
    def resumable(self) -> bool:
        """Only the service keeps KV across an engine restart; other modes ignore state_file."""
        return self.state_file is not None and self.uses_service

    @property
    def listen_targets(self) -> list[str]:
        out = [f"unix:{os.path.abspath(self.uds)}"] if self.uds else []
        return out + ([self.tcp] if self.tcp else [])

    @property
    def service_target(self) -> str:
        return grpc_target(self.service)

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class GenerateConfig:
    """One streaming generation from the `generate` subcommand."""

    target: str
    prompt: tuple[int, ...]
    max_new_tokens: int = 16
    temperature: float = 0.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    resume_request_id: str = ""
    timeout: float = 120.0

    def __post_init__(self) -> None:
        if not self.prompt and not self.resume_request_id:
            raise ValueError("a prompt of at least one token id is needed")
        if any(t < 0 for t in self.prompt):
            raise ValueError("token ids must be >= 0")
        if not 1 <= self.max_new_tokens <= 1 << 20:
            raise ValueError(f"max_new_tokens must be in 1..2^20, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.timeout <= 86400:
            raise ValueError(f"timeout must be in (0, 86400], got {self.timeout}")


@dataclass(frozen=True)
class DemoConfig:
    """The `demo` subcommand: a service and an engine subprocess, a few concurrent streams."""

    kv_mode: str = "service"
    requests: int = 4
    prompt_len: int = 24
    max_new_tokens: int = 24
    device: str = "auto"
    startup_timeout: float = 60.0
    progress: bool = True

    def __post_init__(self) -> None:
        if self.kv_mode not in KV_MODES:
            raise ValueError(f"kv_mode must be one of {KV_MODES}, got {self.kv_mode!r}")
        if not 1 <= self.requests <= 64:
            raise ValueError(f"requests must be in 1..64, got {self.requests}")
        if not 1 <= self.prompt_len <= 4096 or not 1 <= self.max_new_tokens <= 4096:
            raise ValueError("prompt_len and max_new_tokens must be in 1..4096")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if not 0 < self.startup_timeout <= 600:
            raise ValueError(f"startup_timeout must be in (0, 600], got {self.startup_timeout}")
