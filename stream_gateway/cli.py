"""The ``stream-gateway`` command.

Subcommands:

* ``up``: everything on one machine: an embedded ``nats-server`` (JetStream, local data dir),
  the gateway capturing every turn into it, the assembler and the batcher writing batches to
  ``<data dir>/batches``.
* ``serve``: the OpenAI-compatible gateway on one engine; ``--nats-url`` captures its events
  to an existing NATS server or cluster.
* ``tail``: a live, readable view of the events on a NATS server.
* ``assemble``: session events → token-exact trajectories (a durable consumer; run several).
* ``batch``: trajectories → verl training batches (parquet, in the object store and a directory).
* ``prepare-model``: build or convert a local model (``tiny``, ``tiny-agent``, ``smollm2``) and print its path.

This module is the composition root: the only place that wires the gateway, the pipeline and
(lazily, per subcommand) anything else together.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._settings import Settings
from .engines import ENGINE_NAMES, Engine, create_engine


def build_engine(settings: Settings) -> Engine:
    """The engine ``settings`` ask for, built (not started) on the resolved local model."""
    from .model_store import resolve_model

    model = resolve_model(settings.model, settings.model_cache_dir)
    options: dict[str, Any] = {}
    if settings.engine == "transformers":
        options = {
            "served_model_name": settings.served_model_name or _default_name(settings.model),
            "max_batch_size": settings.max_batch_size,
            "max_model_len": settings.max_model_len,
            "device": settings.device,
            "recompute_on_update": settings.kv_cache_on_update == "recompute",
        }
    elif settings.engine == "synthetic":
        options = {
            "served_model_name": settings.served_model_name or "synthetic",
            "tokens_per_second": settings.synthetic_tokens_per_second,
        }
        if settings.max_model_len:
            options["max_model_len"] = settings.max_model_len
    elif settings.engine == "vllm":
        options = {
            "served_model_name": settings.served_model_name or _default_name(settings.model),
            "max_model_len": settings.max_model_len,
        }
    elif settings.engine in ("vllm-http", "sglang-http"):
        if not settings.upstreams and not (settings.upstreams_bucket and settings.nats_url):
            raise SystemExit(
                f"stream-gateway: --engine {settings.engine} needs its servers: --upstream URL (repeatable), "
                "or --upstreams-bucket with --nats-url"
            )
        options = {
            "served_model_name": settings.served_model_name or _default_name(settings.model),
            "max_model_len": settings.max_model_len,
            "upstreams": settings.upstreams,
            "api_key": settings.upstream_api_key,
            "health_interval_s": settings.upstream_health_interval_seconds,
            "health_timeout_s": settings.upstream_health_timeout_seconds,
            "connect_timeout_s": settings.upstream_connect_timeout_seconds,
            "read_timeout_s": settings.upstream_read_timeout_seconds,
            "max_connections": settings.upstream_max_connections,
        }
    return create_engine(settings.engine, model, **options)


def _default_name(model: str) -> str:
    """Clients address the built-in models by their short names, others by their last path part."""
    return model.rstrip("/").rsplit("/", 1)[-1]


def _serve(settings: Settings) -> int:
    import uvicorn

    from ._workers import WorkersRefused, check_workers, listening_socket, run_workers
    from .app import create_app

    try:
        check_workers(settings)
    except WorkersRefused as exc:
        print(f"stream-gateway: {exc}", file=sys.stderr)
        return 2
    if settings.workers > 1:
        return _supervise(lambda: run_workers(settings, _progress))
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
    _run_until_interrupted(run)
    _progress("workers stopped")
    return 0


def _run_until_interrupted(run: Any) -> None:
    """``anyio.run(run)``, ended cleanly by Ctrl-C or SIGTERM (taken as Ctrl-C)."""
    import anyio

    previous = signal.signal(signal.SIGTERM, _terminate_as_interrupt)
    try:
        with contextlib.suppress(KeyboardInterrupt):
            anyio.run(run)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _up(settings: Settings, args: argparse.Namespace) -> int:
    """Embedded NATS, the gateway, the assembler and the batcher, in this process.

    Ctrl-C stops the gateway first (its events are drained to NATS or its outbox), then the
    consumers (their unacknowledged input is redelivered next time), then NATS.
    """
    import anyio
    import uvicorn

    from consumers.assembler import AssemblerConfig, run_assembler
    from consumers.batcher import run_batcher
    from consumers.streams import ConsumerStreams
    from pipeline.embedded import EmbeddedNatsServer, NatsServerConfig

    from ._workers import WorkersRefused, check_workers, run_workers
    from .app import create_app

    data_dir = Path(args.data_dir).expanduser() if args.data_dir else _default_data_dir()
    data_dir.mkdir(parents=True, exist_ok=True)
    batch_dir = data_dir / "batches"
    nats_config = NatsServerConfig(
        host=settings.host, port=args.nats_port, store_dir=data_dir / "nats", monitor_port=args.nats_monitor_port
    )
    say = _progress
    say(f"starting nats-server (JetStream, data in {data_dir / 'nats'})")
    with EmbeddedNatsServer(nats_config) as nats_server:
        servers = (nats_server.url,)
        settings = settings.model_copy(update={"nats_url": nats_server.url, "outbox_dir": data_dir / "outbox"})
        try:
            check_workers(settings)
        except WorkersRefused as exc:
            say(str(exc))
            return 2
        names = ConsumerStreams(prefix=settings.subject_prefix, events=settings.events_stream)
        assembler = AssemblerConfig(
            servers=servers,
            names=names,
            idle_timeout_s=args.idle_timeout,
            default_reward=args.default_reward,
            reward_function=args.reward_function,
        )
        batcher = _batcher_config(args, servers, batch_dir)
        if settings.workers > 1:
            model_name = settings.served_model_name or _default_name(settings.model)
        else:
            say(f"loading model {settings.model!r} on the {settings.engine} engine")
            engine = build_engine(settings)
            app = create_app(engine, settings)
            model_name = engine.model_id
        stream = f"stream {settings.events_stream}, subjects {settings.subject_prefix}.events.>"
        say("ready:")
        workers = f", {settings.workers} workers" if settings.workers > 1 else ""
        say(f"  OpenAI API     http://{settings.host}:{settings.port}/v1   (model {model_name!r}{workers})")
        base = f"http://{settings.host}:{settings.port}"
        say(f"  sessions       {base}/sessions/<id>/v1   (end one: POST {base}/sessions/<id>/close)")
        say(f"  metrics        http://{settings.host}:{settings.port}/metrics")
        say(f"  NATS           {nats_server.url}   ({stream})")
        if nats_server.monitor_url:
            say(f"  NATS monitor   {nats_server.monitor_url}")
        say(f"  trajectories   stream {names.trajectories} (assembler, idle timeout {args.idle_timeout:g} s)")
        say(f"  batches        {batch_dir}   (batches of {batcher.batch_size}, groups of {batcher.group_size})")
        say(f"  new weights    stream-gateway publish-weights --nats-url {nats_server.url} --policy-version N DIR")
        say(f"  watch events:  stream-gateway tail --nats-url {nats_server.url}")

        async def gateway() -> None:
            if settings.workers > 1:
                await run_workers(settings, say)  # until cancelled by Ctrl-C / SIGTERM
                return
            server = uvicorn.Server(uvicorn.Config(app, **uvicorn_options(settings)))
            await server.serve()  # returns on Ctrl-C / SIGTERM, after the gateway's shutdown

        async def everything() -> None:
            async with anyio.create_task_group() as tg:
                tg.start_soon(run_assembler, assembler, say)
                tg.start_soon(run_batcher, batcher, say)
                try:
                    await gateway()
                except KeyboardInterrupt:
                    pass  # uvicorn re-raises the Ctrl-C it handled; stopping is what we are doing
                finally:
                    tg.cancel_scope.cancel()

        # uvicorn (0.54, Server.capture_signals) re-raises the signal it stopped for once it has
        # shut down; SIGTERM's default action would then kill this process before the embedded
        # nats-server (its own process session) is stopped. As Ctrl-C, it ends the run cleanly.
        _run_until_interrupted(everything)
    say("stopped")
    return 0


def _terminate_as_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _tail(args: argparse.Namespace) -> int:
    import anyio

    from pipeline.streams import StreamSpec
    from pipeline.tail import TailError, TailFilter, tail_events

    try:
        flt = TailFilter(
            session=args.session,
            tenant=args.tenant,
            kinds=tuple(args.kinds or ()),
            live=args.live,
            from_start=args.from_start,
        )
    except ValueError as exc:  # an unknown kind
        print(f"stream-gateway tail: {exc}", file=sys.stderr)
        return 2
    spec = StreamSpec(prefix=args.subject_prefix, stream=args.events_stream)
    servers = [s.strip() for s in args.nats_url.split(",") if s.strip()]
    color = sys.stdout.isatty() and not args.no_color

    def write(line: str) -> None:
        print(line, flush=True)

    async def run() -> int:
        return await tail_events(servers, spec, flt, write, limit=args.limit, color=color)

    try:
        with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how one stops watching
            anyio.run(run)
    except TailError as exc:
        print(f"stream-gateway tail: {exc}", file=sys.stderr)
        return 1
    return 0


def _assemble(args: argparse.Namespace) -> int:
    import anyio

    from consumers.assembler import AssemblerConfig, run_assembler
    from consumers.streams import ConsumerStreams

    config = AssemblerConfig(
        servers=tuple(s.strip() for s in args.nats_url.split(",") if s.strip()),
        names=ConsumerStreams(prefix=args.subject_prefix, events=args.events_stream),
        durable=args.durable,
        idle_timeout_s=args.idle_timeout,
        close_grace_s=args.close_grace,
        reward_wait_s=args.reward_wait,
        default_reward=args.default_reward,
        reward_function=args.reward_function,
        reward_timeout_s=args.reward_timeout,
        aborted=args.aborted,
        max_turns=args.max_turns,
        max_tokens=args.max_tokens,
        ack_wait_s=args.ack_wait,
    )
    _progress(f"assembler {config.durable!r} reading {config.names.events} at {args.nats_url}")
    with contextlib.suppress(KeyboardInterrupt):
        anyio.run(run_assembler, config, _progress)
    return 0


def _publish_weights(args: argparse.Namespace) -> int:
    import anyio
    import nats

    from pipeline.policies import publish_policy
    from pipeline.streams import StreamSpec

    servers = [s.strip() for s in args.nats_url.split(",") if s.strip()]
    spec = StreamSpec(prefix=args.subject_prefix, stream=args.events_stream)
    if not Path(args.directory).is_dir():
        print(f"stream-gateway publish-weights: no directory {args.directory}", file=sys.stderr)
        return 2

    async def run() -> int:
        try:
            nc = await nats.connect(servers, name="stream-gateway-publish-weights", connect_timeout=5)
        except Exception as exc:  # nats-py raises several unrelated types for "cannot connect"
            print(f"stream-gateway publish-weights: cannot connect to NATS at {args.nats_url}: {exc}", file=sys.stderr)
            return 1
        try:
            event = await publish_policy(
                nc,
                args.directory,
                args.policy_version,
                spec=spec,
                bucket=args.bucket,
                full=not args.partial,
                weights=args.directory,
                keep_full=args.keep,
                progress=_progress,
            )
        finally:
            await nc.close()
        total = sum(o.size for o in event.objects)
        _progress(
            f"published policy {event.policy_version} ({len(event.objects)} files, {total / 2**20:.1f} MiB, "
            f"{'full' if event.full else 'partial'}) as event {event.event_id}"
        )
        return 0

    try:
        return anyio.run(run)
    except (FileNotFoundError, ValueError) as exc:
        print(f"stream-gateway publish-weights: {exc}", file=sys.stderr)
        return 2


def _batcher_config(args: argparse.Namespace, servers: tuple[str, ...], output_dir: Path | None) -> Any:
    from consumers.batcher import BatcherConfig
    from consumers.streams import ConsumerStreams

    return BatcherConfig(
        servers=servers,
        names=ConsumerStreams(prefix=args.subject_prefix or "sg", events=args.events_stream or "SG_EVENTS"),
        batch_size=args.batch_size,
        group_size=args.group_size,
        group_key=args.group_key,
        max_staleness=args.max_staleness,
        prompt_length=args.prompt_length,
        response_length=args.response_length,
        overlong=args.overlong,
        no_reward=args.no_reward,
        output_dir=output_dir,
    )


def _batch(args: argparse.Namespace) -> int:
    import anyio

    from consumers.batcher import run_batcher

    servers = tuple(s.strip() for s in args.nats_url.split(",") if s.strip())
    output_dir = Path(args.output_dir).expanduser() if args.output_dir else None
    try:
        config = _batcher_config(args, servers, output_dir)
    except ValueError as exc:
        print(f"stream-gateway batch: {exc}", file=sys.stderr)
        return 2
    where = f", parquet files in {output_dir}" if output_dir else ""
    _progress(f"batcher: batches of {config.batch_size} (groups of {config.group_size}) from {args.nats_url}{where}")
    with contextlib.suppress(KeyboardInterrupt):
        anyio.run(run_batcher, config, _progress)
    return 0


def _add_batch_flags(command: argparse.ArgumentParser) -> None:
    command.add_argument("--batch-size", type=int, default=16, help="trajectories per batch (default 16)")
    command.add_argument("--group-size", type=int, default=1, help="GRPO group size; batches hold whole groups")
    command.add_argument("--group-key", default="metadata:group", help="'metadata:<name>' or 'prompt'")
    command.add_argument("--max-staleness", type=int, help="drop samples this many policy versions old")
    command.add_argument("--prompt-length", type=int, default=1024, help="verl prompt length (longer: dropped)")
    command.add_argument("--response-length", type=int, default=2048, help="verl response length")
    command.add_argument("--overlong", choices=("truncate", "drop"), default="truncate", help="too-long responses")
    command.add_argument("--no-reward", choices=("drop", "zero"), default="drop", help="samples without a reward")


def _default_data_dir() -> Path:
    return Path.home() / ".local" / "state" / "stream-gateway" / "up"


def _progress(message: str) -> None:
    print(f"stream-gateway: {message}", file=sys.stderr, flush=True)


def _prepare_model(settings: Settings) -> int:
    from .model_store import resolve_model

    print(resolve_model(settings.model, settings.model_cache_dir))
    return 0


def _add_gateway_flags(command: argparse.ArgumentParser) -> None:
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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stream-gateway", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    up = commands.add_parser("up", help="embedded NATS + the gateway capturing into it, on this machine")
    _add_gateway_flags(up)
    up.add_argument("--data-dir", help="NATS store and outbox (default ~/.local/state/stream-gateway/up)")
    up.add_argument("--nats-port", type=int, default=4222, help="embedded NATS port (default 4222; 0: any free)")
    up.add_argument("--nats-monitor-port", type=int, default=8222, help="its HTTP monitor port (default 8222)")
    up.add_argument("--idle-timeout", type=float, default=900.0, help="assembler: emit sessions idle this long (s)")
    up.add_argument("--default-reward", type=float, help="assembler: reward of sessions with no feedback")
    up.add_argument("--reward-function", help="assembler: module:function computing a reward per trajectory")
    _add_batch_flags(up)
    up_only = ("data_dir", "nats_port", "nats_monitor_port", "idle_timeout", "default_reward", "reward_function")
    batch_only = ("batch_size", "group_size", "group_key", "max_staleness", "prompt_length", "response_length")
    up.set_defaults(run=_up, uses_settings=True, extra=(*up_only, *batch_only, "overlong", "no_reward"))

    serve = commands.add_parser("serve", help="run the OpenAI-compatible gateway")
    _add_gateway_flags(serve)
    serve.add_argument("--nats-url", help="capture events to this NATS server or cluster (comma-separated URLs)")
    serve.add_argument("--outbox-dir", help="disk outbox for events NATS has not taken yet")
    serve.set_defaults(run=_serve, uses_settings=True, extra=())

    tail = commands.add_parser("tail", help="watch events as they are published")
    tail.add_argument("--nats-url", default="nats://127.0.0.1:4222", help="NATS server(s), comma-separated")
    tail.add_argument("--session", help="only this session id")
    tail.add_argument("--tenant", help="only this tenant (as it appears in events)")
    tail.add_argument("--kind", action="append", dest="kinds", help="only this kind, e.g. turn.completed (repeatable)")
    tail.add_argument("--live", action="store_true", help="also show live token deltas")
    tail.add_argument("--from-start", action="store_true", help="replay the stream from its first event")
    tail.add_argument("--limit", type=int, help="stop after this many events")
    tail.add_argument("--events-stream", default="SG_EVENTS", help="the events stream (default SG_EVENTS)")
    tail.add_argument("--subject-prefix", default="sg", help="first token of event subjects (default sg)")
    tail.add_argument("--no-color", action="store_true", help="plain text even on a terminal")
    tail.set_defaults(run=_tail, uses_settings=False)

    assemble = commands.add_parser("assemble", help="turn session events into trajectories (a durable consumer)")
    assemble.add_argument("--nats-url", default="nats://127.0.0.1:4222", help="NATS server(s), comma-separated")
    assemble.add_argument("--durable", default="assembler", help="consumer name; instances with one name share work")
    assemble.add_argument("--events-stream", default="SG_EVENTS", help="the events stream (default SG_EVENTS)")
    assemble.add_argument("--subject-prefix", default="sg", help="first token of subjects (default sg)")
    assemble.add_argument("--idle-timeout", type=float, default=900.0, help="emit a session idle this long (s)")
    assemble.add_argument("--close-grace", type=float, default=30.0, help="wait for late events after close (s)")
    assemble.add_argument("--reward-wait", type=float, default=0.0, help="wait for feedback after close (s)")
    assemble.add_argument("--default-reward", type=float, help="reward of sessions with no feedback")
    assemble.add_argument("--reward-function", help="module:function computing a reward per trajectory")
    assemble.add_argument("--reward-timeout", type=float, default=10.0, help="reward function time limit (s)")
    assemble.add_argument("--aborted", choices=("drop", "keep"), default="drop", help="aborted turns (default drop)")
    assemble.add_argument("--max-turns", type=int, help="emit a session (truncated) at this many turns")
    assemble.add_argument("--max-tokens", type=int, help="cut trajectories at this many tokens")
    assemble.add_argument("--ack-wait", type=float, default=60.0, help="redelivery delay after a crash (s)")
    assemble.set_defaults(run=_assemble, uses_settings=False)

    batch = commands.add_parser("batch", help="group trajectories into verl training batches (a durable consumer)")
    batch.add_argument("--nats-url", default="nats://127.0.0.1:4222", help="NATS server(s), comma-separated")
    batch.add_argument("--output-dir", help="also write each batch as <batch id>.parquet here")
    batch.add_argument("--events-stream", default="SG_EVENTS", help="the events stream (for policy.updated)")
    batch.add_argument("--subject-prefix", default="sg", help="first token of subjects (default sg)")
    _add_batch_flags(batch)
    batch.set_defaults(run=_batch, uses_settings=False)

    publish = commands.add_parser(
        "publish-weights", help="publish a safetensors checkpoint as a new policy version to every gateway"
    )
    publish.add_argument("directory", help="a directory of *.safetensors files (a whole HF state dict, or a part)")
    publish.add_argument("--policy-version", type=int, required=True, help="the new version (above the current)")
    publish.add_argument("--nats-url", default="nats://127.0.0.1:4222", help="NATS server(s), comma-separated")
    publish.add_argument("--partial", action="store_true", help="the files hold only the tensors that changed")
    publish.add_argument("--bucket", default="sg_policies", help="the object store bucket (default sg_policies)")
    publish.add_argument("--keep", type=int, default=2, help="full versions kept in the bucket (default 2)")
    publish.add_argument("--events-stream", default="SG_EVENTS", help="the events stream (default SG_EVENTS)")
    publish.add_argument("--subject-prefix", default="sg", help="first token of subjects (default sg)")
    publish.set_defaults(run=_publish_weights, uses_settings=False)

    prepare = commands.add_parser("prepare-model", help="build/convert a local model and print its path")
    prepare.add_argument("--model", help="'smollm2' (default), 'tiny' or 'tiny-agent'")
    prepare.add_argument("--model-cache-dir", help="where built/converted models are cached")
    prepare.set_defaults(run=_prepare_model, uses_settings=True, extra=())
    return parser


def _exposure_refusal(settings: Settings) -> str | None:
    """Why these settings must not serve: an unreadable key file, or no keys on a public address."""
    import ipaddress

    from ._tenants import read_key_file

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


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``stream-gateway`` console script."""
    args = _parser().parse_args(argv)
    if not args.uses_settings:
        logging.basicConfig(level="WARNING", format="%(levelname)s %(name)s: %(message)s")
        result: int = args.run(args)
        return result
    skip = {"command", "run", "uses_settings", "extra", *args.extra}
    flags = {k: v for k, v in vars(args).items() if k not in skip and v is not None}
    for many in ("api_keys", "admin_api_keys", "upstreams"):
        if many in flags:
            flags[many] = tuple(flags[many])
    settings = Settings(**flags)
    if args.command in ("serve", "up") and (refusal := _exposure_refusal(settings)) is not None:
        print(f"stream-gateway: {refusal}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request to an inference server
    result = args.run(settings, args) if args.extra else args.run(settings)
    return result


if __name__ == "__main__":
    raise SystemExit(main())
