"""The gateway's commands: ``serve`` and ``prepare-model``.

* ``serve``: the OpenAI-compatible gateway on one engine; ``--nats-url`` captures its events
  to an existing NATS server or cluster (credentials and TLS: :mod:`pipeline.connection`).
* ``prepare-model``: build or convert a local model (``tiny``, ``tiny-agent``, ``smollm2``) and print its path.

:func:`add_commands` registers them on the ``stream-gateway`` command, which
:mod:`stream_stack.cli` composes with the pipeline's and the consumers' commands and ``up``;
``python -m stream_gateway.cli`` runs them alone. The gateway never imports the consumers.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
from collections.abc import Sequence
from typing import Any

from pipeline.cli import progress
from pipeline.connection import add_nats_arguments

from stream_gateway._settings import Settings
from stream_gateway.engines import ENGINE_NAMES, build_engine


def serve(settings: Settings) -> int:
    import uvicorn

    from stream_gateway._workers import WorkersRefused, check_workers, listening_socket, run_workers
    from stream_gateway.app import create_app

    try:
        check_workers(settings)
    except WorkersRefused as exc:
        print(f"stream-gateway: {exc}", file=sys.stderr)
        return 2
    if settings.workers > 1:
        return _supervise(lambda: run_workers(settings, progress))
    engine = build_engine(settings)
    app = create_app(engine, settings)
    capture = f"events to {settings.nats_url}" if settings.nats_url else "event capture off (no --nats-url)"
    loop, http = settings.server_stack()
    print(
        f"stream-gateway: {settings.engine} engine, model {engine.model_id!r}, "
        f"OpenAI API at http://{settings.host}:{settings.port}/v1 (metrics at /metrics), {capture}; "
        f"{loop} loop, {http} parser",
        file=sys.stderr,
        flush=True,
    )
    if settings.worker_index is None:
        uvicorn.run(app, **uvicorn_options(settings))
        return 0
    # A worker of --workers N: the port is shared with the other workers (SO_REUSEPORT).
    sock = listening_socket(settings.host, settings.port, reuse_port=True)
    server = uvicorn.Server(uvicorn.Config(app, **uvicorn_options(settings)))
    server.run(sockets=[sock])
    return 0


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """uvicorn's options for the gateway: address, log level, event loop and HTTP parser."""
    loop, http = settings.server_stack()
    return {"host": settings.host, "port": settings.port, "log_level": settings.log_level, "loop": loop, "http": http}


def _supervise(run: Any) -> int:
    """Run the workers' supervisor until Ctrl-C or SIGTERM, which stop every worker gracefully."""
    run_until_interrupted(run)
    progress("workers stopped")
    return 0


def run_until_interrupted(run: Any) -> None:
    """``anyio.run(run)``, ended cleanly by Ctrl-C or SIGTERM (taken as Ctrl-C)."""
    import anyio

    previous = signal.signal(signal.SIGTERM, _terminate_as_interrupt)
    try:
        with contextlib.suppress(KeyboardInterrupt):
            anyio.run(run)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _terminate_as_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _prepare_model(settings: Settings) -> int:
    from stream_gateway.models import resolve_model

    print(resolve_model(settings.model, settings.model_cache_dir))
    return 0


def add_gateway_flags(command: argparse.ArgumentParser) -> None:
    command.add_argument("--model", help="'smollm2' (default), 'tiny', 'tiny-agent', a local HF model dir, or a hub id")
    command.add_argument("--engine", choices=ENGINE_NAMES, help="default: transformers")
    command.add_argument("--served-model-name", help="the model name clients send (default: from --model)")
    command.add_argument("--host", help="default: 127.0.0.1")
    command.add_argument("--port", type=int, help="default: 8000")
    command.add_argument("--api-key", action="append", dest="api_keys", help="accepted key (repeatable)")
    command.add_argument("--api-key-file", help="`key tenant [limit=value ...]` per line; reloaded on SIGHUP")
    command.add_argument(
        "--allow-anonymous",
        action="store_const",
        const=True,
        help="listen on a non-loopback address without keys (otherwise refused)",
    )
    command.add_argument("--max-concurrent-requests-per-key", type=int, help="default per-tenant limit (429 over it)")
    command.add_argument("--requests-per-minute-per-key", type=int, help="default per-tenant limit (429 over it)")
    command.add_argument("--tokens-per-minute-per-key", type=int, help="default per-tenant limit (429 over it)")
    command.add_argument("--max-sessions-per-key", type=int, help="default per-tenant limit of open sessions")
    command.add_argument(
        "--admin-api-key", action="append", dest="admin_api_keys", help="key allowed to load weights (repeatable)"
    )
    command.add_argument(
        "--upstream", action="append", dest="upstreams", help="vllm-http/sglang-http: a server URL (repeatable)"
    )
    command.add_argument("--upstream-api-key", help="bearer key the gateway sends to its inference servers")
    command.add_argument("--upstreams-bucket", help="with --nats-url: follow server URLs written into this KV bucket")
    command.add_argument("--upstream-health-interval-seconds", type=float, help="server health checks (default 2)")
    command.add_argument("--upstream-read-timeout-seconds", type=float, help="longest silence of a server (300)")
    command.add_argument("--max-batch-size", type=int, help="transformers engine batch size (default 16)")
    command.add_argument("--max-model-len", type=int, help="cap on prompt + completion tokens")
    command.add_argument("--device", help="torch device for the transformers engine (default cpu)")
    command.add_argument("--synthetic-tokens-per-second", type=float, help="synthetic engine rate")
    command.add_argument("--default-max-tokens", type=int, help="completion budget when none is asked")
    command.add_argument("--default-temperature", type=float, help="temperature when none is asked (default 1.0)")
    command.add_argument(
        "--durable-wait-seconds",
        type=float,
        help="final chunk waits this long at most for the turn's events (5; 0: no)",
    )
    command.add_argument("--max-request-bytes", type=int, help="largest request body (default 8 MiB; larger: 413)")
    command.add_argument("--max-messages", type=int, help="most messages in one chat request (default 4096)")
    command.add_argument("--model-cache-dir", help="where built/converted models are cached")
    command.add_argument("--log-level", help="uvicorn/gateway log level (default info)")
    command.add_argument("--loop", choices=("auto", "uvloop", "asyncio"), help="event loop (default auto: uvloop)")
    command.add_argument("--http", choices=("auto", "httptools", "h11"), help="HTTP parser (default auto: httptools)")
    command.add_argument("--events-stream", help="JetStream stream for durable events (default SG_EVENTS)")
    command.add_argument("--subject-prefix", help="first token of event subjects (default sg)")
    command.add_argument("--stream-replicas", type=int, help="stream replicas on a NATS cluster (default 1)")
    command.add_argument("--stream-max-bytes", type=int, help="stream size limit in bytes (default unlimited)")
    command.add_argument("--stream-max-age-seconds", type=float, help="stream age limit (default forever)")
    command.add_argument("--no-live-deltas", dest="live_deltas", action="store_const", const=False)
    command.add_argument("--delta-tokens", type=int, help="a live delta every N tokens (default 128)")
    command.add_argument("--delta-interval-ms", type=float, help="...or every T ms (default 50)")
    command.add_argument(
        "--no-follow-policies",
        dest="follow_policies",
        action="store_const",
        const=False,
        help="with --nats-url: do not apply the policies published on NATS",
    )
    command.add_argument(
        "--policy-sync-timeout-seconds", type=float, help="at start, wait this long for the latest policy (300)"
    )
    command.add_argument("--replica-id", help="this gateway's name in policy events (default host-pid)")
    command.add_argument(
        "--workers", type=int, help="gateway processes sharing the port (default 1; needs a shareable engine)"
    )
    command.add_argument(
        "--no-shared-sessions",
        dest="shared_sessions",
        action="store_const",
        const=False,
        help="with --nats-url: keep sessions in this process only (replicas do not share them)",
    )
    command.add_argument("--sessions-bucket", help="NATS KV bucket of the shared session state (sg_sessions)")
    command.add_argument(
        "--session-sync-timeout-seconds", type=float, help="longest wait for the shared session state (1)"
    )
    command.add_argument(
        "--close-sessions-on-shutdown",
        action="store_const",
        const=True,
        help="close open sessions when this gateway stops (default only without shared sessions)",
    )
    command.add_argument(
        "--kv-cache-on-update",
        choices=("recompute", "keep"),
        help="transformers engine, requests in flight at a weight update: recompute their KV cache (exact "
        "logprobs, longer pause; default) or keep it (the pause is the copy alone)",
    )


def _exposure_refusal(settings: Settings) -> str | None:
    """Why these settings must not serve: an unreadable key file, or no keys on a public address."""
    import ipaddress

    from stream_gateway.control._tenants import read_key_file

    if settings.api_key_file is not None:
        try:
            read_key_file(settings.api_key_file)
        except (OSError, ValueError) as exc:
            return f"cannot use --api-key-file: {exc}"
        return None
    if settings.api_keys or settings.allow_anonymous:
        return None
    host = settings.host
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if loopback:
        return None
    return (
        f"refusing to listen on {host} without API keys: anyone who can reach it could use the model and "
        "read every session. Give --api-key or --api-key-file, or --allow-anonymous if that is what you want."
    )


def settings_from_args(args: argparse.Namespace, skip: Sequence[str] = ()) -> Settings:
    """The gateway's settings from its flags (unset flags: environment, then defaults)."""
    ignored = {"command", "run", *skip}
    flags = {k: v for k, v in vars(args).items() if k not in ignored and v is not None}
    for many in ("api_keys", "admin_api_keys", "upstreams"):
        if many in flags:
            flags[many] = tuple(flags[many])
    return Settings(**flags)


def refusal(settings: Settings) -> str | None:
    """Why a gateway must not start with ``settings`` (keys, exposure, NATS options), or ``None``."""
    try:
        settings.nats_auth()
    except ValueError as exc:
        return str(exc)
    return _exposure_refusal(settings)


def configure_logging(settings: Settings) -> None:
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request to an inference server


def _serve_command(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    if (reason := refusal(settings)) is not None:
        print(f"stream-gateway: {reason}", file=sys.stderr)
        return 2
    configure_logging(settings)
    return serve(settings)


def _prepare_model_command(args: argparse.Namespace) -> int:
    return _prepare_model(settings_from_args(args))


def add_commands(commands: Any) -> None:
    """Register ``serve`` and ``prepare-model`` on an ``add_subparsers()`` object."""
    serve = commands.add_parser("serve", help="run the OpenAI-compatible gateway")
    add_gateway_flags(serve)
    add_nats_arguments(serve, url_default=None)
    serve.add_argument("--outbox-dir", help="disk outbox for events NATS has not taken yet")
    serve.set_defaults(run=_serve_command)

    prepare = commands.add_parser("prepare-model", help="build/convert a local model and print its path")
    prepare.add_argument("--model", help="'smollm2' (default), 'tiny' or 'tiny-agent'")
    prepare.add_argument("--model-cache-dir", help="where built/converted models are cached")
    prepare.set_defaults(run=_prepare_model_command)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m stream_gateway.cli serve|prepare-model ...``."""
    parser = argparse.ArgumentParser(prog="stream-gateway", description=__doc__.split("\n\n")[0])
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    result: int = args.run(args)
    return result


if __name__ == "__main__":
    raise SystemExit(main())
