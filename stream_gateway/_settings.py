"""The one configuration object of a gateway process.

Read once at start-up from command-line flags and ``STREAM_GATEWAY_*`` environment variables
(flags win), then passed explicitly. Nothing else in the gateway reads the environment.
"""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

if TYPE_CHECKING:
    from pipeline.connection import NatsAuth


class Settings(BaseSettings):
    """Gateway settings. Every field is also ``STREAM_GATEWAY_<FIELD>`` in the environment."""

    model_config = SettingsConfigDict(env_prefix="STREAM_GATEWAY_", frozen=True)

    model: str = Field("smollm2", description="'smollm2', 'tiny', 'tiny-agent', a local HF model directory or a hub id")
    engine: str = Field("transformers", description="transformers, synthetic, vllm, vllm-http or sglang-http")
    served_model_name: str | None = Field(None, description="model name clients use (default: derived)")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_keys: tuple[str, ...] = Field((), description="accepted bearer keys; empty accepts any key")
    api_key_file: Path | None = Field(
        None, description="file of `key tenant [limit=value ...]` lines (reloaded on SIGHUP); see docs/operations.md"
    )
    allow_anonymous: bool = Field(False, description="serve on a non-loopback address without keys (refused otherwise)")
    max_concurrent_requests_per_key: int | None = Field(None, ge=1, description="default per-tenant limit")
    requests_per_minute_per_key: int | None = Field(None, ge=1, description="default per-tenant limit")
    tokens_per_minute_per_key: int | None = Field(None, ge=1, description="default per-tenant limit")
    max_sessions_per_key: int | None = Field(None, ge=1, description="default per-tenant limit (open sessions)")
    admin_api_keys: tuple[str, ...] = Field((), description="keys allowed to load new weights; empty: nobody")
    model_cache_dir: Path | None = Field(None, description="where built/converted models are cached")

    max_batch_size: int = Field(16, ge=1, description="transformers engine: rows decoded together")
    max_model_len: int | None = Field(None, ge=16, description="cap on prompt + completion tokens")
    device: str = "cpu"
    synthetic_tokens_per_second: float = Field(0.0, ge=0.0, description="synthetic engine rate, 0 = max")

    upstreams: tuple[str, ...] = Field((), description="vllm-http/sglang-http: the inference servers' URLs")
    upstream_api_key: str | None = Field(None, description="bearer key sent to the inference servers")
    upstreams_bucket: str | None = Field(
        None, description="with --nats-url: a NATS KV bucket of server URLs (key: a name, value: the URL) to follow"
    )
    upstream_health_interval_seconds: float = Field(2.0, gt=0, description="how often every server is checked")
    upstream_health_timeout_seconds: float = Field(2.0, gt=0, description="a check not answered this fast fails")
    upstream_connect_timeout_seconds: float = Field(5.0, gt=0, description="connecting to a server")
    upstream_read_timeout_seconds: float = Field(
        300.0, gt=0, description="longest wait for the next bytes of a server's stream (first token included)"
    )
    upstream_max_connections: int = Field(512, ge=1, description="open connections to all servers together")

    tool_parser: str = Field("hermes", description="how tool calls are read from model output (hermes, qwen)")
    max_sessions: int = Field(10_000, ge=1, description="sessions kept in memory before the oldest are evicted")
    session_idle_seconds: float = Field(3600.0, gt=0, description="a session idle this long is evicted")

    nats_url: str | None = Field(None, description="NATS server(s), comma-separated; unset: capture is off")
    nats_user: str | None = Field(None, description="NATS user (with nats_password)")
    nats_password: str | None = Field(None, repr=False, description="NATS password (STREAM_GATEWAY_NATS_PASSWORD)")
    nats_token: str | None = Field(None, repr=False, description="NATS token (STREAM_GATEWAY_NATS_TOKEN)")
    nats_creds: Path | None = Field(None, description="NATS credentials file (user JWT + NKey seed)")
    nats_nkey: Path | None = Field(None, description="file holding the NATS user's NKey seed")
    nats_tls_ca: Path | None = Field(None, description="CA certificate(s) that signed the NATS server's")
    nats_tls_cert: Path | None = Field(None, description="client certificate for NATS servers that verify clients")
    nats_tls_key: Path | None = Field(None, description="the NATS client certificate's key")
    nats_tls_hostname: str | None = Field(None, description="name to expect in the NATS server's certificate")
    shared_sessions: bool = Field(
        True, description="with --nats-url: keep session state in NATS so that any replica continues any session"
    )
    sessions_bucket: str = Field(
        "sg_sessions", pattern=r"^[A-Za-z0-9_-]+$", description="the NATS KV bucket holding shared session state"
    )
    session_sync_timeout_seconds: float = Field(
        1.0, gt=0, description="longest wait for one read or write of the shared session state before falling back"
    )
    session_state_ttl_seconds: float = Field(
        7 * 24 * 3600.0, ge=0, description="shared session state unused this long expires (0: never)"
    )
    close_sessions_on_shutdown: bool | None = Field(
        None,
        description="close open sessions when the gateway stops (default: only when sessions are not shared, "
        "since another replica may continue them)",
    )
    workers: int = Field(1, ge=1, le=64, description="gateway processes sharing the port (needs shared sessions)")
    worker_index: int | None = Field(None, ge=0, description="set by the supervisor in each worker process")
    outbox_dir: Path | None = Field(None, description="disk outbox for events NATS has not taken yet")
    subject_prefix: str = Field("sg", pattern=r"^[A-Za-z0-9_-]+$", description="first token of event subjects")
    events_stream: str = Field("SG_EVENTS", description="JetStream stream holding durable events")
    stream_replicas: int = Field(1, ge=1, le=5, description="replicas of the stream (NATS cluster)")
    stream_max_bytes: int = Field(-1, ge=-1, description="stream size limit, -1 unlimited (oldest go first)")
    stream_max_age_seconds: float = Field(0.0, ge=0, description="stream age limit, 0 keeps events forever")
    event_buffer_size: int = Field(10_000, ge=1, description="durable events held in memory before disk")
    live_deltas: bool = Field(True, description="publish coalesced token deltas on the live subjects")
    delta_tokens: int = Field(128, ge=1, description="a live delta every this many tokens...")
    delta_interval_ms: float = Field(50.0, gt=0, description="...or when this long has passed since the last")

    follow_policies: bool = Field(
        True, description="with --nats-url: apply every policy published on NATS (policy.updated)"
    )
    policy_sync_timeout_seconds: float = Field(
        300.0, ge=0, description="at start, wait this long to come up on the latest published policy"
    )
    kv_cache_on_update: Literal["recompute", "keep"] = Field(
        "recompute",
        description="transformers engine: at a weight update, recompute the KV cache of requests in flight "
        "(every logprob exactly its version's forward pass) or keep it (decoding pauses for the copy alone)",
    )
    replica_id: str | None = Field(None, description="this gateway's name in policy events (default: host-pid)")

    default_max_tokens: int = Field(2048, ge=1, description="completion budget when a request sets none")
    default_temperature: float = Field(
        1.0, ge=0.0, le=2.0, description="sampling temperature when a chat, Messages or Responses request sets none"
    )
    max_n: int = Field(8, ge=1, description="largest accepted n")
    durable_wait_seconds: float = Field(
        5.0,
        ge=0,
        description="with capture: the final chunk waits (at most this long) until the turn's events are in "
        "JetStream or the disk outbox; 0: do not wait",
    )
    max_request_bytes: int = Field(
        8 * 1024 * 1024, ge=1024, description="largest request body; larger ones get 413 before they are read"
    )
    max_messages: int = Field(4096, ge=1, description="most messages in one chat request")
    sse_ping_seconds: float = Field(15.0, gt=0, description="idle seconds before an SSE keep-alive comment")
    sse_send_timeout_seconds: float = Field(30.0, gt=0, description="a client that reads nothing this long is dropped")
    log_level: str = "info"
    loop: Literal["auto", "uvloop", "asyncio"] = Field(
        "auto", description="event loop (auto: uvloop when installed, as uvicorn chooses)"
    )
    http: Literal["auto", "httptools", "h11"] = Field(
        "auto", description="HTTP/1.1 parser (auto: httptools when installed, as uvicorn chooses)"
    )

    def server_stack(self) -> tuple[str, str]:
        """The event loop and HTTP parser uvicorn runs with these settings (``auto`` resolved as uvicorn 0.54 does)."""
        loop = self.loop if self.loop != "auto" else ("uvloop" if find_spec("uvloop") else "asyncio")
        http = self.http if self.http != "auto" else ("httptools" if find_spec("httptools") else "h11")
        return loop, http

    def nats_servers(self) -> tuple[str, ...]:
        """The NATS URLs of ``nats_url`` (empty when capture is off)."""
        from pipeline.connection import split_servers

        return split_servers(self.nats_url or "")

    def nats_auth(self) -> NatsAuth:
        """Credentials and TLS options for every NATS connection the gateway makes."""
        from pipeline.connection import NatsAuth

        return NatsAuth(
            user=self.nats_user,
            password=self.nats_password if self.nats_user else None,
            token=self.nats_token,
            creds=self.nats_creds,
            nkey=self.nats_nkey,
            tls_ca=self.nats_tls_ca,
            tls_cert=self.nats_tls_cert,
            tls_key=self.nats_tls_key,
            tls_hostname=self.nats_tls_hostname,
        )

    @field_validator("tool_parser")
    @classmethod
    def _known_tool_parser(cls, value: str) -> str:
        from stream_gateway.tool_parsers import TOOL_PARSERS

        if value not in TOOL_PARSERS:
            raise ValueError(f"unknown tool parser {value!r}; available: {', '.join(sorted(TOOL_PARSERS))}")
        return value
