"""The one configuration object of a gateway process.

Read once at start-up from command-line flags and ``STREAM_GATEWAY_*`` environment variables
(flags win), then passed explicitly. Nothing else in the gateway reads the environment.

Each field is also the single source of its command-line flag: :func:`stream_gateway.cli.add_gateway_flags`
makes ``--field-name`` from the field's name, type, default and ``description`` (the flag's help).
Where that rule is not the whole story the field says so itself, with a :class:`Flag` in its
annotation (a repeatable list spelled in the singular, values looked up elsewhere), and the
settings that have no flag at all are in :data:`WITHOUT_FLAG`, each with its reason.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

if TYPE_CHECKING:
    from pipeline.connection import NatsAuth


@dataclass(frozen=True, slots=True)
class Flag:
    """What a setting's flag needs beyond the rule: its spelling, and where its choices come from."""

    name: str | None = None
    """The flag, when it is not ``--field-name`` (a repeatable list's flag names one item)."""
    choices: Callable[[], Sequence[str]] | None = None
    """The accepted values, asked for when a parser is built (their registry imports late)."""


def _engine_names() -> Sequence[str]:
    from stream_gateway.engines.registry import ENGINE_NAMES

    return ENGINE_NAMES


def _tool_parser_names() -> Sequence[str]:
    from stream_gateway.tool_parsers import TOOL_PARSERS

    return sorted(TOOL_PARSERS)


WITHOUT_FLAG: Mapping[str, str] = MappingProxyType(
    {
        "worker_index": "set by the --workers supervisor in each worker's environment; "
        "a gateway started by hand is no supervisor's worker",
    }
)
"""Settings that are deliberately not flags, and why (the environment still sets them)."""


class Settings(BaseSettings):
    """Gateway settings. Every field is also ``STREAM_GATEWAY_<FIELD>`` in the environment."""

    model_config = SettingsConfigDict(env_prefix="STREAM_GATEWAY_", frozen=True)

    model: str = Field(
        "smollm2",
        description="'smollm2', 'tiny', 'tiny-agent', 'tiny-reasoning', 'tiny-moe', 'tiny-vl', a local HF model "
        "directory or a hub id",
    )
    engine: Annotated[str, Flag(choices=_engine_names)] = Field(
        "transformers", description="what samples the tokens (see docs/engines.md)"
    )
    served_model_name: str | None = Field(
        None, description="the model name clients send (default: derived from the model)"
    )
    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, ge=0, le=65535, description="port to listen on (0: any free port)")
    api_keys: Annotated[tuple[str, ...], Flag(name="--api-key")] = Field(
        (), description="accepted bearer keys (none given: any key is accepted)"
    )
    api_key_file: Path | None = Field(
        None,
        description="file of `key tenant [limit=value ...]` lines (reloaded on SIGHUP); see docs/operations.md",
    )
    allow_anonymous: bool = Field(
        False, description="listen on a non-loopback address without keys (otherwise refused)"
    )
    max_concurrent_requests_per_key: int | None = Field(
        None, ge=1, description="default per-tenant limit of requests in flight (429 over it)"
    )
    requests_per_minute_per_key: int | None = Field(
        None, ge=1, description="default per-tenant limit of requests per minute (429 over it)"
    )
    tokens_per_minute_per_key: int | None = Field(
        None, ge=1, description="default per-tenant limit of tokens per minute (429 over it)"
    )
    max_sessions_per_key: int | None = Field(
        None, ge=1, description="default per-tenant limit of open sessions (429 over it)"
    )
    admin_api_keys: Annotated[tuple[str, ...], Flag(name="--admin-api-key")] = Field(
        (), description="keys allowed to load new weights (none given: nobody)"
    )
    model_cache_dir: Path | None = Field(
        None, description="where built/converted models are cached (default: ~/.cache/stream-gateway/models)"
    )

    max_batch_size: int = Field(16, ge=1, description="transformers engine: rows decoded together")
    max_model_len: int | None = Field(
        None, ge=16, description="cap on prompt + completion tokens (default: the model's own limit)"
    )
    device: str = Field("cpu", description="torch device of the transformers engine")
    dtype: Literal["model", "auto", "float32", "bfloat16", "float16"] = Field(
        "model",
        description="vllm engine: the weights' dtype; model: the one the model's config.json declares "
        "(vLLM's auto picks bfloat16 on CPU)",
    )
    lora: Annotated[tuple[str, ...], Flag(name="--lora")] = Field(
        (),
        description="transformers engine: a LoRA adapter beside the base, NAME=DIR (a PEFT adapter directory; "
        "repeatable; clients select it with model=NAME, or a key file's adapter=NAME binds a tenant to it)",
    )
    max_loras: int = Field(8, ge=1, le=64, description="transformers engine: most LoRA adapters loaded at once")
    prefix_cache_mb: int = Field(
        1024,
        ge=0,
        description="transformers engine: MiB of recent prompts' keys and values kept, so a prompt continuing "
        "one (an agent's next turn) prefills only its new tokens; 0: off",
    )
    synthetic_tokens_per_second: float = Field(0.0, ge=0.0, description="synthetic engine rate, 0: unthrottled")
    script: Path | None = Field(
        None,
        description="scripted engine: the JSON file of rules it answers by (default: the tiny-agent repertoire; "
        "docs/engines.md#scripted)",
    )
    script_tokens_per_second: float = Field(0.0, ge=0.0, description="scripted engine rate, 0: as fast as it runs")

    upstreams: Annotated[tuple[str, ...], Flag(name="--upstream")] = Field(
        (), description="vllm-http/sglang-http: the inference servers' URLs"
    )
    upstream_api_key: str | None = Field(None, description="bearer key the gateway sends to its inference servers")
    vllm_api: Literal["completions", "generate"] = Field(
        "completions",
        description="vllm-http: /v1/completions (any vLLM), or /inference/v1/generate (vLLM started with "
        "--enable-scale-out), whose per-token weight versions say where a weight update split a turn",
    )
    upstream_weights: Literal["announce", "reload"] = Field(
        "announce",
        description="vllm-http: a new policy version is only recorded (whoever trains updates the servers), or "
        "the gateway loads the checkpoint into every server itself, keeping requests in flight (servers started "
        "with VLLM_SERVER_DEV_MODE=1, reading the same paths)",
    )
    upstreams_bucket: str | None = Field(
        None, description="with --nats-url: a NATS KV bucket of server URLs (key: a name, value: the URL) to follow"
    )
    upstream_health_interval_seconds: float = Field(
        2.0, gt=0, description="how often every inference server is checked"
    )
    upstream_health_timeout_seconds: float = Field(2.0, gt=0, description="a check not answered this fast fails")
    upstream_connect_timeout_seconds: float = Field(5.0, gt=0, description="longest wait to connect to a server")
    upstream_read_timeout_seconds: float = Field(
        300.0, gt=0, description="longest wait for the next bytes of a server's stream (first token included)"
    )
    upstream_max_connections: int = Field(
        512, ge=1, description="generation requests in flight to all servers together (each on its own connection)"
    )
    upstream_stream_interval: int = Field(
        1,
        ge=1,
        description="vllm-http: the fewest sampled tokens a server puts in each streamed frame (vLLM 0.32+'s "
        "stream_interval per request; 1: every token its own frame, the first and last always at once)",
    )
    upstream_stream_interval_max: int | None = Field(
        None,
        ge=1,
        description="vllm-http: the most, asked of new requests while this process's event loop runs late "
        "(as many as a stream samples meanwhile, which the client would get merged anyway; 8 is a start); "
        "unset or equal to --upstream-stream-interval: always that many",
    )

    tool_parser: Annotated[str, Flag(choices=_tool_parser_names)] = Field(
        "hermes", description="how tool calls are read from model output (see docs/http-api.md)"
    )
    tool_error_pattern: str = Field(
        r"^\s*Error",
        description="a tool result whose text matches this regular expression (from its start) reports a failed "
        "call: the `tool_error` signal on the turn that made it (Anthropic's is_error counts too; docs/rewards.md)",
    )
    reasoning_parser: Literal["auto", "qwen3", "deepseek_r1", "none"] = Field(
        "auto",
        description="how thinking is told from the answer in model output (auto: from the chat template, "
        "logged; see docs/reasoning.md)",
    )
    reasoning_history: Literal["keep", "template"] = Field(
        "keep",
        description="at a new user message, keep the model's earlier thinking in the prompt (one chain) or "
        "render the history as the template does (a new root linked to its predecessor)",
    )
    reasoning_key_file: Path | None = Field(
        None,
        description="a file whose bytes key the signatures on thinking blocks and reasoning items; "
        "share it between replicas (unset: a random key per process)",
    )
    max_sessions: int = Field(
        10_000, ge=1, description="sessions kept in memory; beyond it the least recently used are evicted"
    )
    session_idle_seconds: float = Field(3600.0, gt=0, description="a session idle this long is evicted")
    max_session_tokens: int | None = Field(
        20_000_000,
        ge=1,
        description="token ids all sessions' turns may hold in memory (each turn's prompt and output); "
        "beyond it the least recently used sessions are evicted: to the shared sessions with NATS (a later "
        "turn loads them back and builds its prompt cold), closed without; about 8-10 bytes a token",
    )

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
    session_handoff_seconds: float = Field(
        30.0,
        ge=0,
        description="on a NATS cluster, longest a turn's end waits for its shared session entry to be stored, "
        "and a request for another replica's turn to become readable, while a new leader is elected",
    )
    session_state_ttl_seconds: float = Field(
        7 * 24 * 3600.0, ge=0, description="shared session state unused this long expires (0: never)"
    )
    shutdown_grace_seconds: float = Field(
        30.0,
        ge=0,
        description="on SIGINT/SIGTERM, how long streams in flight may run to their end; those still running "
        "then end with an error frame and [DONE], their turns recorded as aborted (reason shutdown)",
    )
    close_sessions_on_shutdown: bool | None = Field(
        None,
        description="close open sessions when the gateway stops (default: only when sessions are not shared, "
        "since another replica may continue them)",
    )
    workers: int = Field(
        1, ge=1, le=64, description="gateway processes sharing the port (needs a shareable engine and shared sessions)"
    )
    worker_index: int | None = Field(None, ge=0, description="set by the supervisor in each worker process")
    outbox_dir: Path | None = Field(None, description="disk outbox for events NATS has not taken yet")
    subject_prefix: str = Field("sg", pattern=r"^[A-Za-z0-9_-]+$", description="first token of event subjects")
    events_stream: str = Field("SG_EVENTS", description="JetStream stream holding durable events")
    stream_replicas: int = Field(1, ge=1, le=5, description="replicas of the stream on a NATS cluster")
    stream_max_bytes: int = Field(
        -1, ge=-1, description="stream size limit in bytes, -1: unlimited (the oldest events go first)"
    )
    stream_max_age_seconds: float = Field(0.0, ge=0, description="stream age limit, 0: events are kept forever")
    image_max_age_seconds: float = Field(
        0.0, ge=0, description="image store age limit (an image in use is stored again), 0: kept forever"
    )
    outbox_max_age_seconds: float | None = Field(
        None,
        ge=0,
        description="outbox files older than this are deleted unsent (default: --stream-max-age-seconds; 0: never)",
    )
    event_buffer_size: int = Field(10_000, ge=1, description="durable events held in memory before the disk outbox")
    live_deltas: bool = Field(True, description="publish coalesced token deltas on the live subjects")
    delta_tokens: int = Field(128, ge=1, description="a live delta every this many tokens...")
    delta_interval_ms: float = Field(500.0, gt=0, description="...or when this long has passed since the last")

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
    routed_experts: bool = Field(
        True,
        description="mixture-of-experts models: record the experts that routed every position (docs/moe.md); "
        "off: nothing recorded, nothing paid",
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
        8 * 1024 * 1024, ge=1024, description="largest request body in bytes; larger ones get 413 before they are read"
    )
    max_messages: int = Field(4096, ge=1, description="most messages in one chat request")
    max_images_per_request: int = Field(
        32, ge=0, description="vision-language models: most images in one request (docs/images.md)"
    )
    max_image_bytes: int = Field(
        10 * 1024 * 1024, ge=1024, description="largest image, in bytes once decoded from base64"
    )
    max_image_pixels: int = Field(
        40_000_000, ge=64, description="largest image, in pixels (width x height) as its header says, before decoding"
    )
    allow_image_urls: Annotated[tuple[str, ...], Flag(name="--allow-image-url")] = Field(
        (),
        description="a host whose http(s) image URLs the gateway may fetch (repeatable; none: only data: URLs; "
        "a private or loopback address only when named)",
    )
    image_fetch_timeout_seconds: float = Field(10.0, gt=0, description="an image URL not fetched this fast is refused")
    image_cache_bytes: int = Field(
        256 * 1024 * 1024,
        ge=0,
        description="processed images kept in memory, by hash (a conversation's images "
        "are processed once, not once per turn)",
    )
    history_cache_bytes: int = Field(
        512 * 1024 * 1024,
        ge=0,
        description="chat request histories kept in memory, one per conversation (its body's bytes, parsed "
        "messages and recorded render): a next turn whose body repeats them byte for byte reads and renders "
        "only what it adds; 0: every body is read whole",
    )
    sse_ping_seconds: float = Field(15.0, gt=0, description="idle seconds before an SSE keep-alive comment")
    sse_send_timeout_seconds: float = Field(30.0, gt=0, description="a client that reads nothing this long is dropped")
    log_level: str = Field("info", description="log level of the gateway and uvicorn")
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

    @field_validator("lora")
    @classmethod
    def _named_adapters(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        names = [item.partition("=")[0] for item in value]
        for item, name in zip(value, names, strict=True):
            if not name or "=" not in item or not item.partition("=")[2]:
                raise ValueError(f"--lora {item!r}: expected NAME=DIR")
        if len(set(names)) != len(names):
            raise ValueError("--lora: an adapter name appears twice")
        return value

    def lora_adapters(self) -> dict[str, str]:
        """``--lora``: adapter name -> its directory."""
        return dict(item.split("=", 1) for item in self.lora)

    @field_validator("tool_error_pattern")
    @classmethod
    def _compiles(cls, value: str) -> str:
        try:
            re.compile(value)
        except re.error as exc:
            raise ValueError(f"--tool-error-pattern {value!r}: not a regular expression ({exc})") from None
        return value

    @field_validator("tool_parser")
    @classmethod
    def _known_tool_parser(cls, value: str) -> str:
        from stream_gateway.tool_parsers import TOOL_PARSERS

        if value not in TOOL_PARSERS:
            raise ValueError(f"unknown tool parser {value!r}; available: {', '.join(sorted(TOOL_PARSERS))}")
        return value
