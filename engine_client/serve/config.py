"""The engine's configuration: frozen, validated dataclasses built once in __main__ from flags
and passed down explicitly. Each `setting` field is a flag of `serve` whose default comes from an
ENGINE_* environment variable (contract.flags); `local`'s fields are flags too."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from contract.flags import setting
from contract.layout import MAX_DRAFT_TOKENS, KVLayout
from engine_client.client.address import grpc_target
from engine_client.loop.queue_policy import QUEUE_POLICIES
from engine_client.model.preset import PRESETS
from engine_client.text.vocabulary import DEEPSEEK, TINY

__all__ = ["grpc_target"]  # re-exported: the CLI configs parse addresses with it

KV_MODES = ("baseline", "embedded", "service", "service-remote-swap")
SPECULATIVE = ("none", "mtp")
DEVICES = ("auto", "cpu", "cuda")
KERNELS = ("auto", "triton", "reference")
TOKENIZER_NAMES = (DEEPSEEK, TINY)
MAX_UDS_PATH_BYTES = 107
TCP_RE = re.compile(r"(\[[0-9a-fA-F:]+\]|[\w.-]*):\d{1,5}")


def default_uds(env: dict[str, str], name: str) -> str:
    """$XDG_RUNTIME_DIR is per user and not world-writable, so prefer it over /tmp."""
    return str(Path(env.get("XDG_RUNTIME_DIR") or "/tmp") / name)


def engine_target_default(env) -> str:
    """Where a client finds the engine without a flag: ENGINE_TARGET, else the default socket."""
    return env.get("ENGINE_TARGET") or default_uds(dict(env), "hisparse-engine.sock")


def check_uds(path: str) -> None:
    if len(os.fsencode(path)) > MAX_UDS_PATH_BYTES:
        raise ValueError(f"uds path is longer than {MAX_UDS_PATH_BYTES} bytes: {path}")


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

    def __post_init__(self) -> None:
        self.layout(num_layers=1, topk=max(1, self.hot_slots - self.window))

    def layout(self, num_layers: int, topk: int) -> KVLayout:
        return KVLayout(num_layers=num_layers, topk=topk, **dataclasses.asdict(self))


@dataclass(frozen=True)
class EngineConfig:
    """Everything `python -m engine_client serve` can be told. See `--help` for each field."""

    kv_mode: str = setting("service", help=f"where KV lives: {', '.join(KV_MODES)}")
    uds: str = setting(
        "",
        help="Unix socket path the engine listens on",
        cli_default=lambda env: default_uds(dict(env), "hisparse-engine.sock"),
    )
    tcp: str | None = setting(None, help="also listen on HOST:PORT (insecure)")
    http: str | None = setting(
        None,
        help="also serve the OpenAI-compatible HTTP gateway on HOST:PORT, in this process "
        "(python -m engine_client gateway runs it alone); empty: off",
    )
    model_name: str = setting("hisparse", help="the model name the HTTP gateway serves")
    service: str = setting(
        "",
        help="KV service address (socket path, unix:PATH or HOST:PORT); service modes only",
        cli_default=lambda env: default_uds(dict(env), "hisparse-kv.sock"),
    )
    preset: str = setting("tiny", help="model shapes: tiny, bench or v32")
    tokenizer: str | None = setting(
        None,
        help="tokenizer.json of the model (any tokenizers file), or deepseek-v3.2 / "
        "deepseek-v3.2-tiny; empty: the preset's (tiny: deepseek-v3.2-tiny, else "
        "deepseek-v3.2); the model's vocabulary size follows it",
    )
    num_layers: int | None = setting(
        None,
        help="override the preset's layer count; service modes adopt the service's layers "
        "and top-k (a different value here is refused)",
    )
    checkpoint: str | None = setting(
        None,
        help="safetensors file or directory (DeepSeek-V3.2 names); empty: seeded random weights",
    )
    weight_seed: int = setting(0, help="seed of the random weights")
    device: str = setting("auto", help=f"{', '.join(DEVICES)}; service modes use the service's GPU")
    kernels: str = setting(
        "auto",
        help=f"{', '.join(KERNELS)}: auto is Triton on CUDA and the "
        "torch references on CPU (Triton's interpreter is ~30x slower)",
    )
    cuda_graphs: bool = setting(
        True, help="capture the decode step as CUDA graphs per batch bucket"
    )
    cpu_threads: int = setting(
        1,
        help="torch CPU threads; more than the free cores makes OpenMP "
        "spin against the KV service and slows CPU mode down by 10-30x",
    )
    max_batch: int = setting(8, help="most requests admitted and decoded together")
    prefill_chunk: int = setting(32, help="prompt tokens per prefill chunk (one chunk per step)")
    local: LocalLayout = field(default_factory=LocalLayout)
    state_file: str | None = setting(
        None,
        help="resume state (session id, prompts, tokens, "
        "seeds) so a restarted engine continues its requests; "
        "service modes; empty disables",
    )
    engine_name: str = setting("engine", help="name shown in the service's logs")
    token: str | None = setting(
        None,
        secret=True,
        help="KV service token; prefer the env variable (flags are visible in ps)",
    )
    rpc_timeout: float = setting(5.0, help="deadline in seconds of every call to the KV service")
    attach_timeout: float = setting(
        5.0,
        help="seconds to wait for the KV service at start (and "
        "for each attach); the compose files wait 60",
    )
    heartbeat_interval: float = setting(1.0, help="seconds between Session heartbeats")
    admit_retry: float = setting(
        0.5, help="seconds between admission retries while the service has no capacity"
    )
    # Benchmark hooks (bench/e2e.py): KVBackend.fill_synthetic instead of a prefill, and a top-k
    # source factory "MODULE:FUNC[:JSON kwargs]".
    synthetic_context: int = setting(
        0,
        help="benchmarks: prefix every prompt with this many "
        "synthetic context tokens, filled with random KV instead "
        "of a prefill",
    )
    synthetic_shared: int = setting(
        0,
        help="benchmarks: the first N tokens of the synthetic context are the same for every "
        "request (shared by prefix caching), the rest differ per request",
    )
    topk_source: str = setting(
        "indexer",
        help="benchmarks: decode top-k from the model's "
        "indexer, or from MODULE:FUNC[:JSON] (e.g. bench.trace:trace_source)",
    )
    # Speculative decoding (engine_client/model/spec_runner.py, loop/speculative.py).
    speculative: str = setting(
        "none",
        choices=SPECULATIVE,
        help="mtp: the model's MTP layer drafts --draft-tokens tokens per step and each step "
        "verifies them (D + 1 rows per request); the KV layout holds the MTP layer's KV as its "
        "last layer (service modes: start the service with one more layer)",
    )
    draft_tokens: int = setting(1, help="speculative: drafts per verify step, 1..3")
    draft_source: str = setting(
        "mtp",
        help="speculative: mtp (the model's MTP layer), or MODULE:FUNC[:JSON], a BENCHMARK-ONLY "
        "source of drafts (bench.draft_replay:replay_source replays a recorded greedy run: "
        "acceptance is the recording's, not the model's)",
    )
    # The engine loop (engine_client/loop/engine.py).
    overlap: bool = setting(
        True,
        help="launch decode step t + 1 before step t's tokens reach "
        "the host (0: wait for every step; debugging)",
    )
    # The queue (engine_client/loop/scheduler.py, queue_policy.py).
    queue_policy: str = setting(
        "skip-ahead",
        choices=QUEUE_POLICIES,
        help="admission order once the queue's head is refused for KV capacity: fifo (nothing "
        "passes it) or skip-ahead (smaller requests pass it for --skip-ahead seconds)",
    )
    skip_ahead: float = setting(
        5.0,
        help="skip-ahead: seconds smaller requests may pass a queue head waiting for KV capacity",
    )
    max_queue_wait: float = setting(
        300.0,
        help="seconds a request may wait for admission "
        "before it fails with RESOURCE_EXHAUSTED; 0: no limit",
    )
    metrics_port: int | None = setting(
        None, help="serve Prometheus /metrics on this port; empty: off"
    )
    metrics_address: str = setting("127.0.0.1", help="address of the /metrics endpoint")
    # Prefix caching (kv_service/books/ledger.py, engine_client/loop/scheduler.py).
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
    model_fingerprint: str = setting(
        "",
        help="names the model and weights; only engines with the same fingerprint share "
        "cached pages; empty: derived from the preset shapes and the weights (seed, or "
        "samples of the checkpoint files)",
    )
    # HiSparseBackend.microbatches. On by default (docs/DECISIONS.md, copy/compute overlap):
    # 2 parts cut the H200 step at 32K x 128 requests from 11.55 to 9.97 ms (bench/profile.py).
    decode_microbatches: int = setting(
        2,
        help="embedded/service: split each decode step into "
        "this many parts whose host->GPU miss copy overlaps the "
        "other parts' compute; 1 = off",
    )
    log_level: str = setting("INFO", help="logging level", parse=str.upper)

    def __post_init__(self) -> None:
        if self.kv_mode not in KV_MODES:
            raise ValueError(f"kv_mode must be one of {KV_MODES}, got {self.kv_mode!r}")
        if not self.uds and not self.tcp:
            raise ValueError("the engine needs a uds path or a tcp address to listen on")
        if self.uds:
            check_uds(self.uds)
        if self.tcp is not None and not TCP_RE.fullmatch(self.tcp):
            raise ValueError(f"tcp must be HOST:PORT, got {self.tcp!r}")
        if self.http is not None and not TCP_RE.fullmatch(self.http):
            raise ValueError(f"http must be HOST:PORT, got {self.http!r}")
        if self.uses_service and not self.service:
            raise ValueError(f"kv_mode {self.kv_mode} needs the service address")
        if self.preset not in PRESETS:
            raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {self.preset!r}")
        if self.tokenizer is not None and not (
            self.tokenizer in TOKENIZER_NAMES or Path(self.tokenizer).is_file()
        ):
            raise ValueError(f"tokenizer must be {' or '.join(TOKENIZER_NAMES)} or a file")
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
        if self.token is not None and (
            not self.token.isprintable() or " " in self.token or not self.token
        ):
            raise ValueError("token must be non-empty printable text without spaces")
        for name in ("rpc_timeout", "attach_timeout", "heartbeat_interval", "admit_retry"):
            if not 0 < getattr(self, name) <= 3600:
                raise ValueError(f"{name} must be in (0, 3600] seconds, got {getattr(self, name)}")
        if not self.engine_name or len(self.engine_name) > 128:
            raise ValueError("engine_name must be 1..128 characters")
        if self.synthetic_context < 0:
            raise ValueError(f"synthetic_context must be >= 0, got {self.synthetic_context}")
        if not 0 <= self.synthetic_shared <= self.synthetic_context:
            raise ValueError(
                f"synthetic_shared must be in [0, synthetic_context], got {self.synthetic_shared}"
            )
        if self.queue_policy not in QUEUE_POLICIES:
            raise ValueError(
                f"queue_policy must be one of {QUEUE_POLICIES}, got {self.queue_policy!r}"
            )
        for name in ("skip_ahead", "max_queue_wait"):
            if not 0 <= getattr(self, name) <= 86400:
                raise ValueError(f"{name} must be in [0, 86400] seconds, got {getattr(self, name)}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in 0..65535, got {self.metrics_port}")
        if not self.metrics_address:
            raise ValueError("metrics_address must not be empty")
        if not 1 <= self.decode_microbatches <= 64:
            raise ValueError(
                f"decode_microbatches must be in 1..64, got {self.decode_microbatches}"
            )
        if self.speculative not in SPECULATIVE:
            raise ValueError(f"speculative must be one of {SPECULATIVE}, got {self.speculative!r}")
        if not 1 <= self.draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(
                f"draft_tokens must be in 1..{MAX_DRAFT_TOKENS}, got {self.draft_tokens}"
            )
        if self.draft_source != "mtp" and ":" not in self.draft_source:
            raise ValueError(
                f"draft_source must be 'mtp' or MODULE:FUNC, got {self.draft_source!r}"
            )
        if self.topk_source != "indexer" and ":" not in self.topk_source:
            raise ValueError(
                f"topk_source must be 'indexer' or MODULE:FUNC, got {self.topk_source!r}"
            )
        if len(self.model_fingerprint.encode()) > 128 or not self.model_fingerprint.isprintable():
            raise ValueError("model_fingerprint must be at most 128 bytes of printable text")
        if self.log_level not in logging.getLevelNamesMapping():
            raise ValueError(f"log_level must be a logging level name, got {self.log_level!r}")

    @property
    def spec_tokens(self) -> int:
        """Drafts per step: draft_tokens with --speculative mtp, else 0."""
        return self.draft_tokens if self.speculative == "mtp" else 0

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
