"""The service's configuration: one frozen, validated dataclass, built once in __main__ and
passed down explicitly."""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from contract.flags import setting
from contract.layout import KVLayout

# sun_path of a sockaddr_un holds 108 bytes including the terminating NUL.
MAX_UDS_PATH_BYTES = 107
DEVICES = ("auto", "cpu", "cuda")
SOCKET_MODES = (0o600, 0o660)
INSTANCE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def default_uds_path(env: dict[str, str]) -> str:
    """$XDG_RUNTIME_DIR is per user and not world-writable, so prefer it over /tmp."""
    base = env.get("XDG_RUNTIME_DIR") or "/tmp"
    return str(Path(base) / "hisparse-kv.sock")


# DeepSeek-V3.2-shaped: the service's layout when no flag or env says otherwise.
DEFAULT_LAYOUT = KVLayout(
    num_layers=61,
    max_requests=64,
    hot_slots=4096,
    window=128,
    topk=2048,
    page_size=64,
    num_pages=2048,
    max_context=131072,
)
LOG_LEVELS = tuple(logging.getLevelNamesMapping())


@dataclass(frozen=True)
class ServiceConfig:
    """Everything `python -m kv_service` can be told: each field is a flag and a KVS_* env
    variable (contract.flags), the layout's fields included."""

    layout: KVLayout = DEFAULT_LAYOUT
    uds: str = setting(
        "",
        help="Unix socket path to listen on",
        cli_default=lambda env: default_uds_path(dict(env)),
    )
    tcp: str | None = setting(None, help="also listen on HOST:PORT (insecure; use with a token)")
    device: str = setting("auto", help="auto, cpu or cuda (pick the GPU with CUDA_VISIBLE_DEVICES)")
    token: str | None = setting(
        None,
        secret=True,
        help="shared secret; clients send "
        "'authorization: Bearer <token>'. Prefer the env variable: "
        "flags are visible in ps",
    )
    lease_seconds: float = setting(
        30.0,
        help="how long a session's requests survive without "
        "an open Session stream (engine restart window)",
    )
    drain_timeout: float = setting(
        30.0,
        help="on SIGTERM, seconds to wait for admitted requests to be released before stopping",
    )
    metrics_port: int | None = setting(
        None, help="serve Prometheus /metrics on this port; empty disables"
    )
    # Loopback by default: the metrics page needs no token and names sessions' load.
    metrics_address: str = setting(
        "127.0.0.1",
        help="address the metrics port binds: 127.0.0.1 "
        "keeps it on this host; 0.0.0.0 or :: exposes it (it has no auth)",
    )
    shm_dir: str = setting("/dev/shm", help="directory of the shared-memory segment files")
    instance: str = setting("hisparse-kv", help="instance name, part of segment file names")
    socket_mode: int = setting(
        0o600,
        help="socket file mode, 600 or 660 (octal)",
        parse=lambda text: int(text, 8),
        show=lambda mode: f"{mode:o}",
    )
    max_message_bytes: int = setting(4 * 1024 * 1024, help="largest gRPC message accepted or sent")
    warmup: bool = setting(
        True,
        help="on CUDA, compile and run the swap kernels once before reporting SERVING (0 disables)",
    )
    nixl: bool = setting(
        False,
        help="register the host tier and index-key pool with a NIXL agent, so prefill engines "
        "write prompt KV into them (prefill/decode disaggregation; needs the nixl package)",
    )
    log_level: str = setting("INFO", help="logging level", parse=str.upper)

    def __post_init__(self) -> None:
        if not self.uds:
            raise ValueError("uds path must be set")
        if len(os.fsencode(self.uds)) > MAX_UDS_PATH_BYTES:
            raise ValueError(f"uds path is longer than {MAX_UDS_PATH_BYTES} bytes: {self.uds}")
        if self.tcp is not None and not re.fullmatch(
            r"(\[[0-9a-fA-F:]+\]|[\w.-]*):\d{1,5}", self.tcp
        ):
            raise ValueError(f"tcp must be HOST:PORT, got {self.tcp!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.token is not None and (
            not self.token or not self.token.isprintable() or " " in self.token
        ):
            raise ValueError("token must be non-empty printable text without spaces")
        if not 0 < self.lease_seconds <= 86400:
            raise ValueError(f"lease_seconds must be in (0, 86400], got {self.lease_seconds}")
        if not 0 <= self.drain_timeout <= 3600:
            raise ValueError(f"drain_timeout must be in [0, 3600], got {self.drain_timeout}")
        if self.metrics_port is not None and not 0 < self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in 1..65535, got {self.metrics_port}")
        if not re.fullmatch(r"[0-9A-Za-z.:_-]+", self.metrics_address):
            raise ValueError(
                f"metrics_address must be an IP address or host name, got {self.metrics_address!r}"
            )
        if not Path(self.shm_dir).is_dir():
            raise ValueError(f"shm_dir is not a directory: {self.shm_dir}")
        if not INSTANCE_RE.match(self.instance):
            raise ValueError(f"instance must match {INSTANCE_RE.pattern}, got {self.instance!r}")
        if self.socket_mode not in SOCKET_MODES:
            raise ValueError(f"socket_mode must be 0600 or 0660, got {oct(self.socket_mode)}")
        if not 64 * 1024 <= self.max_message_bytes <= 1 << 30:
            raise ValueError(
                f"max_message_bytes must be in [64 KiB, 1 GiB], got {self.max_message_bytes}"
            )
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")
