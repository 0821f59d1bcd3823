"""Where the engine's KV lives (`kv_mode`) and, in service modes, how the engine reaches the KV
service and keeps its session there: the address, token, deadlines, heartbeats, and the state
file a restarted engine resumes its requests from."""

from __future__ import annotations

from dataclasses import dataclass

from contract.flags import setting
from contract.rules import check_settings, length, one_of, seconds, text
from engine_client.client.address import default_uds, grpc_target

KV_MODES = ("baseline", "embedded", "service", "service-remote-swap")


@dataclass(frozen=True)
class KVAccess:
    """The KV mode and the engine's side of the KV service's session."""

    kv_mode: str = setting(
        "service", help=f"where KV lives: {', '.join(KV_MODES)}", check=one_of(KV_MODES)
    )
    service: str = setting(
        "",
        help="KV service address (socket path, unix:PATH or HOST:PORT); service modes only",
        cli_default=lambda env: default_uds(env, "hisparse-kv.sock"),
    )
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

    def __post_init__(self) -> None:
        check_settings(self)
        if self.uses_service and not self.service:
            raise ValueError(f"kv_mode {self.kv_mode} needs the service address")

    @property
    def uses_service(self) -> bool:
        return self.kv_mode in ("service", "service-remote-swap")

    @property
    def resumable(self) -> bool:
        """Only the service keeps KV across an engine restart; other modes ignore state_file."""
        return self.state_file is not None and self.uses_service

    @property
    def service_target(self) -> str:
        return grpc_target(self.service)
