"""Configuration of the client-side commands (`generate`, `demo`): frozen, validated dataclasses
built once in engine_client.cli.main from flags (GENERATE_* / DEMO_* env defaults,
contract.flags)."""

from __future__ import annotations

from dataclasses import dataclass

from contract.flags import setting
from engine_client.client.address import engine_target_default, grpc_target
from engine_client.serve.settings.execution import DEVICES
from engine_client.serve.settings.kv_access import KV_MODES

# Proto field limits: token ids are int32, the seed uint64 (decode.v1.GenerateRequest).
TOKEN_ID_LIMIT = 2**31
SEED_LIMIT = 2**64


def token_ids(text: str) -> tuple[int, ...]:
    """'1,2,3' -> (1, 2, 3), with a hint for text given where ids belong."""
    try:
        return tuple(int(t) for t in text.replace(",", " ").split())
    except ValueError:
        raise ValueError("token ids are integers like 1,2,3; for text use --text") from None


def _check_ids(flag: str, ids: tuple[int, ...]) -> None:
    bad = next((t for t in ids if not 0 <= t < TOKEN_ID_LIMIT), None)
    if bad is not None:
        raise ValueError(f"{flag}: token id {bad} is out of range: ids are in [0, 2^31)")


@dataclass(frozen=True)
class GenerateConfig:
    """One streaming generation from the `generate` subcommand (flags default to GENERATE_* env
    variables, so that a compose file's ENGINE_* settings never steer a client)."""

    target: str = setting(
        help="engine address: socket path, unix:PATH or HOST:PORT; default "
        "GENERATE_TARGET, else ENGINE_TARGET, else the engine's default socket",
        parse=grpc_target,
        cli_default=engine_target_default,
    )
    prompt: tuple[int, ...] = setting(
        (1, 2, 3, 4),
        flag="ids",
        help="prompt token ids, e.g. '1,2,3' (prints ids); --text or --chat replaces them",
        parse=token_ids,
    )
    text: str = setting("", help="prompt text, tokenized by the engine; prints text as it streams")
    chat: str = setting(
        "", help="a user message, sent as a chat in the model's chat format; prints text"
    )
    max_new_tokens: int = setting(16, help="most tokens to generate")
    temperature: float = setting(0.0, help="sampling temperature; 0 is greedy")
    seed: int = setting(0, help="sampling seed")
    stop_token_ids: tuple[int, ...] = setting(
        (), flag="stop", help="stop token ids, e.g. '2,7'", parse=token_ids
    )
    resume_request_id: str = setting(
        "", flag="resume", help="request id to resume after an engine restart (serve --state-file)"
    )
    cache_salt: str = setting(
        "", help="prefix-cache salt: share cached prompt pages only with the same salt"
    )
    timeout: float = setting(120.0, help="deadline in seconds of the whole stream")
    connect_timeout: float = setting(
        5.0, help="seconds to wait for the engine to accept the connection"
    )

    @property
    def text_output(self) -> bool:
        return bool(self.text or self.chat)

    def __post_init__(self) -> None:
        if self.text and self.chat:
            raise ValueError("give --text or --chat, not both")
        if not self.prompt and not self.resume_request_id and not self.text and not self.chat:
            raise ValueError("a prompt is needed: --ids, --text or --chat")
        _check_ids("--ids", self.prompt)
        _check_ids("--stop", self.stop_token_ids)
        if not 0 <= self.seed < SEED_LIMIT:
            raise ValueError(f"--seed {self.seed} is out of range: seeds are in [0, 2^64)")
        if not 1 <= self.max_new_tokens <= 1 << 20:
            raise ValueError(f"max_new_tokens must be in 1..2^20, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.timeout <= 86400:
            raise ValueError(f"timeout must be in (0, 86400], got {self.timeout}")
        if not 0 < self.connect_timeout <= 3600:
            raise ValueError(f"connect_timeout must be in (0, 3600], got {self.connect_timeout}")


@dataclass(frozen=True)
class DemoConfig:
    """The `demo` subcommand: a service and an engine subprocess, a few concurrent streams.
    Flags default to DEMO_* env variables (not ENGINE_*: a compose file must not steer it)."""

    kv_mode: str = setting("service", choices=KV_MODES, help="where KV lives")
    requests: int = setting(4, help="concurrent generations")
    prompt_len: int = setting(24, help="random prompt tokens per generation")
    max_new_tokens: int = setting(24, help="tokens generated per generation")
    device: str = setting("auto", choices=DEVICES, help="device of the service and the engine")
    startup_timeout: float = setting(
        60.0, help="seconds to wait for the service and the engine to become healthy"
    )
    progress: bool = setting(
        True, flag="no_progress", negated=True, help="plain log lines, no live display"
    )

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
