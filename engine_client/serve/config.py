"""The engine's configuration: frozen, validated dataclasses built once in __main__ from flags
and passed down explicitly. Each `setting` field is a flag of `serve` whose default comes from an
ENGINE_* environment variable (contract.flags); `local`'s fields are flags too.

One concept, the engine's configuration: `EngineConfig` and the layout of the engine's own KV
memory in local modes (`LocalLayout`), each setting with its rule (`contract.rules`)."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from contract.flags import setting
from contract.layout import MAX_DRAFT_TOKENS, KVLayout, check_shared_slots
from contract.rules import (
    at_least,
    check_settings,
    host_port,
    length,
    non_empty,
    one_of,
    plugin_or,
    positive,
    seconds,
    text,
    within,
)
from engine_client.client.address import ENGINE_SOCKET, default_uds, grpc_target
from engine_client.loop.acceptance_rates import BENCHMARK_ONLY, AcceptanceRates, check_rates
from engine_client.loop.admission_setting import admission_setting
from engine_client.loop.queue_policy import QUEUE_POLICIES
from engine_client.model.preset import PRESETS
from engine_client.text.vocabulary import DEEPSEEK, TINY

KV_MODES = ("baseline", "embedded", "service", "service-remote-swap")
ROLES = ("both", "prefill", "decode")
SPECULATIVE = ("none", "mtp")
DEVICES = ("auto", "cpu", "cuda")
KERNELS = ("auto", "triton", "reference")
TOKENIZER_NAMES = (DEEPSEEK, TINY)
MAX_UDS_PATH_BYTES = 107
LOG_LEVELS = tuple(logging.getLevelNamesMapping())


def check_uds(path: str) -> None:
    if len(os.fsencode(path)) > MAX_UDS_PATH_BYTES:
        raise ValueError(f"uds path is longer than {MAX_UDS_PATH_BYTES} bytes: {path}")


def _socket_path(name: str, value: str) -> None:
    check_uds(value)


def _tokenizer(name: str, value: str) -> None:
    if not (value in TOKENIZER_NAMES or Path(value).is_file()):
        raise ValueError(f"{name} must be {' or '.join(TOKENIZER_NAMES)} or a file")


def _existing_path(name: str, value: str) -> None:
    if not Path(value).exists():
        raise ValueError(f"{name} does not exist: {value}")


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


@dataclass(frozen=True)
class EngineConfig:
    """Everything `python -m engine_client serve` can be told. See `--help` for each field."""

    kv_mode: str = setting(
        "service", help=f"where KV lives: {', '.join(KV_MODES)}", check=one_of(KV_MODES)
    )
    role: str = setting(
        "both",
        choices=ROLES,
        help="prefill/decode disaggregation over NIXL: both (prefill and decode here), prefill "
        "(computes prompts and writes their KV into a decode side's pages; baseline mode) or "
        "decode (admits, has --prefill-peer prefill, then decodes; service mode)",
        check=one_of(ROLES),
    )
    prefill_peer: tuple[str, ...] = setting(
        (),
        help="--role decode: the prefill engines' addresses (socket path, unix:PATH, HOST:PORT), "
        "comma-separated or the flag repeated; taken round-robin, skipping a peer down or full",
    )
    uds: str = setting(
        "",
        help="Unix socket path the engine listens on",
        cli_default=lambda env: default_uds(env, ENGINE_SOCKET),
        check=_socket_path,
    )
    tcp: str | None = setting(None, help="also listen on HOST:PORT (insecure)", check=host_port)
    http: str | None = setting(
        None,
        help="also serve the OpenAI-compatible HTTP gateway on HOST:PORT, in this process "
        "(python -m engine_client gateway runs it alone); empty: off",
        check=host_port,
    )
    model_name: str = setting("hisparse", help="the model name the HTTP gateway serves")
    service: str = setting(
        "",
        help="KV service address (socket path, unix:PATH or HOST:PORT); service modes only",
        cli_default=lambda env: default_uds(env, "hisparse-kv.sock"),
    )
    preset: str = setting(
        "tiny", help="model shapes: tiny, bench or v32", check=one_of(sorted(PRESETS))
    )
    tokenizer: str | None = setting(
        None,
        help="tokenizer.json of the model (any tokenizers file), or deepseek-v3.2 / "
        "deepseek-v3.2-tiny; empty: the preset's (tiny: deepseek-v3.2-tiny, else "
        "deepseek-v3.2); the model's vocabulary size follows it",
        check=_tokenizer,
    )
    num_layers: int | None = setting(
        None,
        help="override the preset's layer count; service modes adopt the service's layers "
        "and top-k (a different value here is refused)",
        check=positive,
    )
    checkpoint: str | None = setting(
        None,
        help="safetensors file or directory (DeepSeek-V3.2 names); empty: seeded random weights",
        check=_existing_path,
    )
    weight_seed: int = setting(0, help="seed of the random weights")
    device: str = setting(
        "auto",
        help=f"{', '.join(DEVICES)}; service modes use the service's GPU",
        check=one_of(DEVICES),
    )
    kernels: str = setting(
        "auto",
        help=f"{', '.join(KERNELS)}: auto is Triton on CUDA and the "
        "torch references on CPU (Triton's interpreter is ~30x slower)",
        check=one_of(KERNELS),
    )
    cuda_graphs: bool = setting(
        True, help="capture the decode step as CUDA graphs per batch bucket"
    )
    cpu_threads: int = setting(
        1,
        help="torch CPU threads; more than the free cores makes OpenMP "
        "spin against the KV service and slows CPU mode down by 10-30x",
        check=within(1, 1024),
    )
    max_batch: int = setting(
        8, help="most requests admitted and decoded together", check=within(1, 4096)
    )
    prefill_chunk: int = setting(
        32, help="prompt tokens per prefill chunk (one chunk per step)", check=within(1, 65536)
    )
    local: LocalLayout = field(default_factory=LocalLayout)
    state_file: str | None = setting(
        None,
        help="resume state (session id, prompts, tokens, "
        "seeds) so a restarted engine continues its requests; "
        "service modes; empty disables",
    )
    engine_name: str = setting(
        "engine", help="name shown in the service's logs", check=length(1, 128)
    )
    token: str | None = setting(
        None,
        secret=True,
        help="KV service token; prefer the env variable (flags are visible in ps)",
        check=text(4096, empty=False, spaces=False),
    )
    rpc_timeout: float = setting(
        5.0,
        help="deadline in seconds of every call to the KV service",
        check=seconds(3600, zero=False),
    )
    attach_timeout: float = setting(
        5.0,
        help="seconds to wait for the KV service at start (and "
        "for each attach); the compose files wait 60",
        check=seconds(3600, zero=False),
    )
    heartbeat_interval: float = setting(
        1.0, help="seconds between Session heartbeats", check=seconds(3600, zero=False)
    )
    admit_retry: float = setting(
        0.5,
        help="seconds between admission retries while the service has no capacity",
        check=seconds(3600, zero=False),
    )
    # Benchmark hooks (bench/e2e.py): KVBackend.fill_synthetic instead of a prefill, and a top-k
    # source factory "MODULE:FUNC[:JSON kwargs]".
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
    # Speculative decoding (engine_client/model/speculative_runner.py, loop/speculative.py).
    speculative: str = setting(
        "none",
        choices=SPECULATIVE,
        help="mtp: the model's MTP layer drafts --draft-tokens tokens per step and each step "
        "verifies them (D + 1 rows per request); the KV layout holds the MTP layer's KV as its "
        "last layer (service modes: start the service with one more layer)",
        check=one_of(SPECULATIVE),
    )
    draft_tokens: int = setting(
        1, help="speculative: drafts per verify step, 1..3", check=within(1, MAX_DRAFT_TOKENS)
    )
    speculative_acceptance: tuple[float, ...] | None = setting(
        None,
        help="BENCHMARK-ONLY, refused without --allow-benchmark-only: accept drafts by a seeded "
        "draw instead of checking them, at these acceptance rates per draft position (e.g. 0.9 "
        "or 0.9,0.75,0.6; rate i given drafts before i were accepted; positions past the list "
        "repeat its last rate). The drafts still come from the MTP layer and are verified over "
        "D + 1 rows; the output is the accepted drafts and the model's token after them, not "
        "the model's own decoding (engine_client/loop/synthetic_acceptance.py)",
        check=check_rates,
    )
    speculative_acceptance_seed: int = setting(
        0, help="BENCHMARK-ONLY: seed of --speculative-acceptance's draws (a run repeats)"
    )
    allow_benchmark_only: bool = setting(
        False,
        help="allow BENCHMARK-ONLY settings (--speculative-acceptance), which make the output "
        "not the model's; refused without it",
    )
    batch_invariant: bool = setting(
        False,
        help="1: every GEMM and norm of the model through batch-invariant kernels (kernels/dense/: "
        "fixed K walk, no split-K, tiles chosen without M), so a row's logits never depend on "
        "its batch: greedy MTP equals plain decoding bit for bit; costs speed "
        "(docs/DECISIONS.md)",
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
        check=one_of(QUEUE_POLICIES),
    )
    skip_ahead: float = setting(
        5.0,
        help="skip-ahead: seconds smaller requests may pass a queue head waiting for KV capacity",
        check=seconds(86400, zero=True),
    )
    admission_limit: str = setting(
        "auto",
        help="most requests running at once, below --max-batch: adaptive (admit while one more "
        "request raises the measured decode throughput; the miss copy of poor locality can make "
        "it fall), off (--max-batch), a number (fixed), or auto (adaptive in embedded/service "
        "modes, off in baseline)",
        check=admission_setting,
    )
    max_queue_wait: float = setting(
        300.0,
        help="seconds a request may wait for admission "
        "before it fails with RESOURCE_EXHAUSTED; 0: no limit",
        check=seconds(86400, zero=True),
    )
    metrics_port: int | None = setting(
        None, help="serve Prometheus /metrics on this port; empty: off", check=within(0, 65535)
    )
    metrics_address: str = setting(
        "127.0.0.1", help="address of the /metrics endpoint", check=non_empty
    )
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
        check=text(128),
    )
    # HiSparseBackend.microbatches. On by default (docs/DECISIONS.md, copy/compute overlap):
    # 2 parts cut the H200 step at 32K x 128 requests from 11.55 to 9.97 ms (bench/profile.py).
    decode_microbatches: int = setting(
        2,
        help="embedded/service: split each decode step into "
        "this many parts whose host->GPU miss copy overlaps the "
        "other parts' compute; 1 = off",
        check=within(1, 64),
    )
    log_level: str = setting(
        "INFO", help="logging level", parse=str.upper, check=one_of(LOG_LEVELS)
    )

    def __post_init__(self) -> None:
        check_settings(self)
        # The rules that tie settings together.
        if not self.uds and not self.tcp:
            raise ValueError("the engine needs a uds path or a tcp address to listen on")
        if self.uses_service and not self.service:
            raise ValueError(f"kv_mode {self.kv_mode} needs the service address")
        if self.role == "decode" and not (self.kv_mode == "service" and self.prefill_peer):
            raise ValueError("--role decode needs --kv-mode service and --prefill-peer")
        if self.local.shared_slots and self.kv_mode != "embedded":
            raise ValueError("--shared-slots is embedded mode's only, for now (issue 40)")
        if self.role == "prefill" and self.kv_mode != "baseline":
            raise ValueError("--role prefill computes prompts in its own cache: --kv-mode baseline")
        if self.synthetic_shared > self.synthetic_context:
            raise ValueError(
                f"synthetic_shared must be in [0, synthetic_context], got {self.synthetic_shared}"
            )
        self._check_acceptance()
        self._check_disaggregated_speculation()

    def _check_disaggregated_speculation(self) -> None:
        """Refused, not silently wrong: docs/DECISIONS.md, "Speculative decoding is refused with
        disaggregation"."""
        if not self.spec_tokens or (self.role == "both" and not self.prefill_peer):
            return
        raise ValueError(
            f"--speculative mtp with --role {self.role}"
            f"{' --prefill-peer' if self.prefill_peer else ''} is not supported: a prompt "
            "prefilled by a peer lands without the MTP layer's first drafts (the transfer "
            "carries KV rows, not the last hidden state the drafts need), so its first verify "
            "step would check a previous request's drafts; use --speculative none with "
            "--role/--prefill-peer, or --role both with --speculative mtp"
        )

    def _check_acceptance(self) -> None:
        if self.speculative_acceptance is None:
            return
        if not self.allow_benchmark_only:
            raise ValueError(
                f"--speculative-acceptance is {BENCHMARK_ONLY}: its tokens are not the model's "
                "output; pass --allow-benchmark-only to run it anyway"
            )
        if not self.spec_tokens:
            raise ValueError("--speculative-acceptance needs --speculative mtp")
        # Its own checks: at most one rate per draft position.
        AcceptanceRates(self.speculative_acceptance, self.spec_tokens)

    @property
    def acceptance(self) -> AcceptanceRates | None:
        """The BENCHMARK-ONLY synthetic acceptance rule, if set."""
        if self.speculative_acceptance is None or not self.spec_tokens:
            return None
        return AcceptanceRates(
            self.speculative_acceptance, self.spec_tokens, self.speculative_acceptance_seed
        )

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
