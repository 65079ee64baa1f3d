"""The ``stream-gateway`` command: every package's commands, and ``up``, which runs them all.

* ``up``: everything on one machine: an embedded ``nats-server`` (JetStream, local data dir),
  the gateway capturing every turn into it, the assembler and the batcher writing batches to
  ``<data dir>/batches``; with ``--scorer``, the reward worker too.
* ``serve``, ``prepare-model``: the gateway's (:mod:`stream_gateway.cli`).
* ``tail``, ``publish-weights``: the pipeline's (:mod:`pipeline.cli`).
* ``assemble``, ``reward``, ``batch``, ``flush``, ``pending``: the consumers' (:mod:`consumers.cli`).
* ``forget`` (erasure), ``console`` (the trajectory console), ``verify`` (recorded logprobs
  against a forward pass): this package's own.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import UTC
from pathlib import Path
from typing import TYPE_CHECKING

import consumers.cli
import pipeline.cli
import stream_gateway.cli
from pipeline.cli import progress
from pipeline.connection import add_nats_arguments
from stream_gateway import Settings
from stream_gateway.cli import (
    ENVIRONMENT_NOTE,
    WorkersRefused,
    add_gateway_flags,
    check_workers,
    configure_logging,
    refusal,
    run_until_interrupted,
    run_workers,
    settings_from_args,
    uvicorn_options,
)
from stream_gateway.engines import build_engine, default_name

if TYPE_CHECKING:
    from consumers.assembler import AssemblerConfig
    from consumers.batcher import BatcherConfig
    from consumers.reward_worker import RewardWorkerConfig
    from consumers.streams import ConsumerStreams
    from pipeline.embedded import EmbeddedNatsServer
    from stream_stack.console import ConsoleConfig

__all__ = ["main", "parser"]

_SET_BY_UP = ("outbox_dir", "stream_replicas")
"""Settings ``up`` decides itself, so that it has no flag for them: the outbox lives in its data dir,
and its NATS is the embedded server, one server, so one replica of everything (and no NATS options)."""


_DAY = 24 * 3600.0
UP_RETENTION = {
    "stream_max_age_seconds": 30 * _DAY,  # events (and the oversized-payload bucket, and the outbox with them)
    "image_max_age_seconds": 30 * _DAY,  # images (stored again while in use)
    "session_state_ttl_seconds": 7 * _DAY,  # shared session records, from their last use
    "trajectories_max_age_seconds": 30 * _DAY,
    "batches_max_age_seconds": 30 * _DAY,  # the batches stream and bucket
    "parquet_max_age_seconds": 30 * _DAY,  # <data dir>/batches/*.parquet
}
"""``up``'s retention of each store where neither a flag nor ``STREAM_GATEWAY_*`` says otherwise
(docs/data-rights.md); ``serve``, ``assemble`` and ``batch`` keep everything unless told."""


def default_data_dir() -> Path:
    return Path.home() / ".local" / "state" / "stream-gateway" / "up"


def _up_command(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    given = settings.model_fields_set
    settings = settings.model_copy(update={k: v for k, v in UP_RETENTION.items() if k in Settings.model_fields
                                           and k not in given})  # fmt: skip
    for name, value in UP_RETENTION.items():  # the consumers' flags
        if name not in Settings.model_fields and getattr(args, name, None) is None:
            setattr(args, name, value)
    if (reason := refusal(settings)) is not None:
        print(f"stream-gateway: {reason}", file=sys.stderr)
        return 2
    try:
        _up_rewards(args)
    except ValueError as exc:
        print(f"stream-gateway up: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings)
    return up(settings, args)


def up(settings: Settings, args: argparse.Namespace) -> int:  # noqa: PLR0915  (the start-up in order, one place)
    """Embedded NATS, the gateway, the assembler, the batcher (and the reward worker), in this process.

    Ctrl-C stops the gateway first (its events are drained to NATS or its outbox), then the
    consumers (their unacknowledged input is redelivered next time), then NATS.
    """
    import anyio
    import uvicorn

    from consumers.assembler import AssemblerConfig, run_assembler
    from consumers.batcher import run_batcher
    from consumers.cli import batcher_config, reward_worker_config
    from consumers.reward_worker import run_reward_worker
    from consumers.streams import ConsumerStreams
    from pipeline.connection import NatsAuth
    from pipeline.embedded import EmbeddedNatsServer, NatsServerConfig
    from stream_gateway.app import create_app

    data_dir = Path(args.data_dir).expanduser() if args.data_dir else default_data_dir()
    data_dir.mkdir(parents=True, exist_ok=True)
    batch_dir = data_dir / "batches"
    nats_config = NatsServerConfig(
        host=settings.host, port=args.nats_port, store_dir=data_dir / "nats", monitor_port=args.nats_monitor_port
    )
    say = progress
    say(f"starting nats-server (JetStream, data in {data_dir / 'nats'})")
    with EmbeddedNatsServer(nats_config) as nats_server:
        servers = (nats_server.url,)
        settings = settings.model_copy(
            update={"nats_url": nats_server.url, "outbox_dir": data_dir / "outbox", "stream_replicas": 1}
        )
        try:
            check_workers(settings)
        except WorkersRefused as exc:
            say(str(exc))
            return 2
        names = ConsumerStreams(
            prefix=settings.subject_prefix, events=settings.events_stream, replicas=settings.stream_replicas
        )
        assembler = AssemblerConfig(
            servers=servers,
            names=replace(names, trajectories_max_age_s=args.trajectories_max_age_seconds),
            idle_timeout_s=args.idle_timeout,
            default_reward=args.default_reward,
            reward_function=args.reward_function,
        )
        batcher = batcher_config(args, servers, NatsAuth(), batch_dir, replicas=settings.stream_replicas)
        console = _up_console(args, settings, servers, names, data_dir, batch_dir)
        if settings.workers > 1:
            model_name = settings.served_model_name or default_name(settings.model)
        else:
            say(f"loading model {settings.model!r} on the {settings.engine} engine")
            engine = build_engine(settings)
            app = create_app(engine, settings)
            model_name = engine.model_id
        if console is not None:
            console = replace(console, tokenizers=console_tokenizers(settings, model_name))
        rewarder = None
        if args.scorer:
            try:
                rewarder = reward_worker_config(
                    args, servers, NatsAuth(), assembler.names, tokenizers=console_tokenizers(settings, model_name),
                    metrics_host=settings.host, metrics_port=args.reward_metrics_port or None,
                )  # fmt: skip
            except (ValueError, OSError) as exc:
                say(f"stream-gateway up: {exc}")
                return 2
        say("ready:")
        for line in _ready(settings, model_name, nats_server, names, assembler, batcher, batch_dir, console, rewarder):
            say(line)

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
                if rewarder is not None:
                    tg.start_soon(run_reward_worker, rewarder, say)
                if console is not None:
                    tg.start_soon(_console_beside, console, say)
                try:
                    await gateway()
                except KeyboardInterrupt:
                    pass  # uvicorn re-raises the Ctrl-C it handled; stopping is what we are doing
                finally:
                    tg.cancel_scope.cancel()

        # uvicorn (0.54, Server.capture_signals) re-raises the signal it stopped for once it has
        # shut down; SIGTERM's default action would then kill this process before the embedded
        # nats-server (its own process session) is stopped. As Ctrl-C, it ends the run cleanly.
        run_until_interrupted(everything)
    say("stopped")
    return 0


async def _console_beside(console: ConsoleConfig, say: Callable[[str], None]) -> None:
    """``up``'s console: one that cannot start (its port taken) is said, and everything else runs on."""
    from stream_stack.console import run_console

    try:
        await run_console(console)
    except* (OSError, SystemExit) as group:  # uvicorn exits (SystemExit) when it cannot bind
        errors = [e if isinstance(e, OSError) else e.__context__ for e in group.exceptions]
        reason = next((e for e in errors if isinstance(e, OSError)), group.exceptions[0])
        say(f"console: not started on port {console.port} ({reason}); the rest of up runs without it")


UP_AWAIT_S = 60.0
"""How long ``up`` holds a trajectory for the scores its ``--reward`` needs, unless ``--await-scorer`` says."""


def _up_rewards(args: argparse.Namespace) -> None:
    """``up``'s choices about rewards, made explicit in ``args`` (``ValueError``: flags that do not fit,
    said before anything starts).

    With scorers: the reward is the one scorer, or what ``--reward`` says (several need it), and
    every scorer it names is awaited :data:`UP_AWAIT_S` seconds unless ``--await-scorer`` says.
    """
    from consumers.batcher import BatcherConfig
    from consumers.scorers import parse_scorer
    from consumers.scores import RewardFormula

    names = [parse_scorer(text).name for text in args.scorer or ()]
    if args.reward is None and names:
        if len(names) > 1:
            raise ValueError(f"scorers {', '.join(names)}: say how they make a reward with --reward, "
                             f"e.g. --reward 0.5*{names[0]}+0.5*{names[1]}")  # fmt: skip
        args.reward = names[0]
    if args.reward is not None:  # without --scorer: scored by workers of its own (stream-gateway reward)
        missing = RewardFormula.parse(args.reward).scorers - set(names)
        if names and missing:
            raise ValueError(f"--reward {args.reward}: no --scorer {', '.join(sorted(missing))}")
        if not args.await_scorer:
            args.await_scorer = [(name, UP_AWAIT_S) for name in sorted(RewardFormula.parse(args.reward).scorers)]
    BatcherConfig(reward=args.reward, await_scorers=tuple(args.await_scorer or ()))  # its checks, now


def _up_console(
    args: argparse.Namespace,
    settings: Settings,
    servers: tuple[str, ...],
    names: ConsumerStreams,
    data_dir: Path,
    batch_dir: Path,
) -> ConsoleConfig | None:
    """``up``'s console: on ``--console-port`` (0: none), its index in the data dir, the gateway's keys."""
    if not args.console_port:
        return None
    from stream_stack.console import ConsoleConfig

    local = "127.0.0.1" if settings.host in ("0.0.0.0", "::", "") else settings.host
    return ConsoleConfig(
        servers=servers, index_path=data_dir / "console.sqlite", host=settings.host, port=args.console_port,
        names=names, api_keys=settings.api_keys, api_key_file=settings.api_key_file,
        admin_api_keys=settings.admin_api_keys, batch_dirs=(batch_dir,),
        gateway_url=f"http://{local}:{settings.port}",  # ratings go to up's own gateway
    )  # fmt: skip


def _ready(
    settings: Settings,
    model_name: str,
    nats_server: EmbeddedNatsServer,
    names: ConsumerStreams,
    assembler: AssemblerConfig,
    batcher: BatcherConfig,
    batch_dir: Path,
    console: ConsoleConfig | None = None,
    rewarder: RewardWorkerConfig | None = None,
) -> list[str]:
    """``up``'s banner: where each part listens or writes, and the commands to use them."""
    url, monitor = nats_server.url, nats_server.monitor_url
    base = f"http://{settings.host}:{settings.port}"
    workers = f", {settings.workers} workers" if settings.workers > 1 else ""
    stream = f"stream {settings.events_stream}, subjects {settings.subject_prefix}.events.>"
    command = _command_path()
    reward = "no reward: dropped" if assembler.default_reward is None else f"reward {assembler.default_reward:g}"
    size, groups = batcher.grouping.batch_size, batcher.grouping.group_size
    return [
        f"  OpenAI API     {base}/v1   (model {model_name!r}{workers})",
        f"  sessions       {base}/sessions/<id>/v1   (end one: POST {base}/sessions/<id>/close)",
        f"  metrics        {base}/metrics",
        *(
            [
                f"  console        {console.url}   (sessions, turn trees, tokens as training sees them; "
                "sign in with an API key)"
            ]
            if console is not None
            else []
        ),
        f"  NATS           {url}   ({stream})",
        *([f"  NATS monitor   {monitor}"] if monitor else []),
        f"  trajectories   stream {names.trajectories} (a session's, once it is closed or idle "
        f"{assembler.idle_timeout_s:g} s; without feedback: {reward})",
        *_reward_lines(assembler, batcher, rewarder, settings.host),
        f"  batches        {batch_dir}   (batches of {size}, groups of {groups})",
        "  retention      "
        + ", ".join(
            f"{what} {_days(seconds)}"
            for what, seconds in (
                ("events", settings.stream_max_age_seconds),
                ("images", settings.image_max_age_seconds),
                ("session records", settings.session_state_ttl_seconds),
                ("trajectories", assembler.names.trajectories_max_age_s),
                ("batches", batcher.names.batches_max_age_s),
                ("parquet files", batcher.parquet_max_age_s),
            )
        ),
        f"  waiting:       {command} pending --nats-url {url}   (each session, and why)",
        f"  flush a batch  {command} flush --nats-url {url}   (what is held now, fewer than {size})",
        f"  new weights    {command} publish-weights --nats-url {url} --policy-version N DIR",
        f"  watch events:  {command} tail --nats-url {url}",
    ]


def _reward_lines(
    assembler: AssemblerConfig, batcher: BatcherConfig, rewarder: RewardWorkerConfig | None, host: str
) -> list[str]:
    """The banner's rewards: which scorers run, the reward made of them, and what a trajectory
    that has neither feedback nor a score trains with, said rather than left a silent 0."""
    default = assembler.default_reward
    fallback = "dropped (--default-reward none)"
    if default is not None:
        fallback = f'reward {default:g} (--default-reward: a placeholder, not a judgement; reward_source "default")'
    if batcher.reward is None:
        return [f"  rewards        feedback only: no scorer runs (--scorer NAME=SPEC); without feedback: {fallback}"]
    if rewarder is None:
        worker = "none here: scores from stream-gateway reward processes of your own on this NATS"
    else:
        worker = ", ".join(f"{spec.name} ({spec.spec})" for spec in rewarder.scorers)
        worker += "" if rewarder.metrics_port is None else f"; metrics http://{host}:{rewarder.metrics_port}/metrics"
    awaited = ", ".join(f"{name} up to {seconds:g} s" for name, seconds in batcher.await_scorers) or "none"
    return [
        f"  rewards        reward worker: {worker}",
        f"                 reward = {batcher.reward} (a user's feedback wins); awaited: {awaited}",
        f"                 without feedback or every score: {fallback}, flagged unscored",
    ]


def _command_path() -> str:
    """How to run this command again from any shell: the venv's script by its path when it is
    not on ``PATH`` (the README runs ``.venv/bin/stream-gateway up`` without activating the venv)."""
    import shutil

    script = Path(sys.executable).with_name("stream-gateway")
    if script.exists() and shutil.which("stream-gateway") != str(script):
        return str(script)
    return "stream-gateway"


def _days(seconds: float | None) -> str:
    if not seconds:
        return "kept"
    return f"{seconds / _DAY:g} d" if seconds >= _DAY else f"{seconds:g} s"


def _forget_command(args: argparse.Namespace) -> int:
    """``stream-gateway forget``: erase a session or a tenant everywhere, print the receipt (JSON)."""
    import json

    import anyio

    from pipeline.cli import nats_from_args
    from pipeline.connection import connect
    from stream_stack.erasure import ErasureTarget, find_session_tenants, forget, tenant_token

    if args.session is None and args.tenant is None:
        print("stream-gateway forget: name what to forget: --session ID and/or --tenant NAME", file=sys.stderr)
        return 2
    if (nats := nats_from_args(args, "forget")) is None:
        return 2
    servers, auth = nats

    dirs = tuple(Path(d).expanduser() for d in args.batches_dir or ())

    async def run() -> int:
        try:
            nc = await connect(servers, auth, name="stream-gateway-forget", max_reconnect_attempts=2)
        except Exception as exc:
            progress(f"forget: refused, NATS at {args.nats_url} unreachable ({exc}); nothing was done")
            return 1
        try:
            if args.tenant is not None:
                tokens = [tenant_token(args.tenant)]
            else:
                tokens = await find_session_tenants(nc, args.session)
                if len(tokens) > 1:
                    progress(
                        f"forget: session {args.session!r} exists in {len(tokens)} tenants; name one with --tenant"
                    )
                    return 2
            receipts = []
            for token in tokens:
                target = ErasureTarget(token, args.session, batch_dirs=dirs, grace_s=args.grace, before=args.before)
                try:
                    receipts.append((await forget(nc, target, progress)).to_json())
                except Exception as exc:
                    done = getattr(exc, "receipt", None)
                    steps = ", ".join(done.steps_done) if done is not None else "none"
                    progress(
                        f"forget: stopped by {exc!r}; steps done: {steps}. Run it again to finish (it is idempotent)."
                    )
                    if done is not None:
                        print(json.dumps(done.to_json(), indent=2))
                    return 1
            if not receipts:
                progress(f"forget: no events of session {args.session!r} in any tenant: nothing to erase")
                receipts.append({"what": "session", "sessions": 0, "events": 0, "complete": True})
            for receipt in receipts:
                print(json.dumps(receipt, indent=2))
            return 0
        finally:
            with anyio.move_on_after(2, shield=True):
                await nc.close()

    result: int = anyio.run(run)
    return result


def _console_command(args: argparse.Namespace) -> int:
    """``stream-gateway console``: the trajectory console, reading NATS (docs/console.md)."""

    from consumers.streams import ConsumerStreams
    from pipeline.cli import nats_from_args
    from stream_stack.console import ConsoleConfig, run_console

    if (nats := nats_from_args(args, "console")) is None:
        return 2
    servers, auth = nats
    try:
        tokenizers = dict(_tokenizer_spec(spec) for spec in args.model or ())
    except ValueError as exc:
        print(f"stream-gateway console: {exc}", file=sys.stderr)
        return 2
    config = ConsoleConfig(
        servers=servers,
        auth=auth,
        index_path=None if args.index == ":memory:" else Path(args.index).expanduser(),
        host=args.host,
        port=args.port,
        names=ConsumerStreams(prefix=args.subject_prefix, events=args.events_stream),
        api_keys=tuple(args.api_key or ()),
        api_key_file=Path(args.api_key_file) if args.api_key_file else None,
        admin_api_keys=tuple(args.admin_api_key or ()),
        tokenizers=tokenizers,
        batch_dirs=tuple(Path(d).expanduser() for d in args.batches_dir or ()),
        gateway_url=args.gateway_url,
    )
    try:
        run_until_interrupted(lambda: run_console(config, progress))
    except OSError as exc:  # the port taken, NATS unreachable
        progress(f"console: {exc}")
        return 1
    return 0


def _verify_command(args: argparse.Namespace) -> int:
    """``stream-gateway verify``: recompute a batch's logprobs with a checkpoint; the mismatch per row."""
    import json

    import torch
    from transformers import AutoModelForCausalLM

    from consumers.parquet import decode_batch
    from consumers.verify import verify_rows
    from stream_gateway.models import resolve_model

    path = Path(args.batch).expanduser()
    try:
        trajectories, _ = decode_batch(path.read_bytes())
    except (OSError, ValueError) as exc:
        print(f"stream-gateway verify: cannot read {path}: {exc}", file=sys.stderr)
        return 2
    where = resolve_model(args.model)
    progress(f"verify: {len(trajectories)} rows in {path.name}; loading {where}")
    model = AutoModelForCausalLM.from_pretrained(where, dtype=getattr(torch, args.dtype))
    model.eval()  # type: ignore[no-untyped-call]  # transformers 5.10: nn.Module.eval is untyped here
    report = verify_rows(
        trajectories, model, rows=args.rows, threshold=args.threshold, temperature=args.temperature, seed=args.seed
    )
    if args.format == "json":
        print(json.dumps(report.to_json(), indent=2))
    else:
        print(f"{'row':>4}  {'trajectory':<36}{'sampled':>8}{'max|Δ|':>10}{'mean|Δ|':>10}{'ratio min..max':>18}"
              f"{'KL':>10}  flag")  # fmt: skip
        for r in report.rows:
            flag = r.skipped or ("FLAGGED" if r.flagged else "ok")
            print(f"{r.row:>4}  {r.trajectory_id:<36}{r.sampled:>8}{r.max_abs_delta:>10.2e}{r.mean_abs_delta:>10.2e}"
                  f"{f'{r.ratio_min:.4f}..{r.ratio_max:.4f}':>18}{r.kl:>10.2e}  {flag}")  # fmt: skip
        summary = report.summary()
        print(f"rows {summary['rows_checked']} checked, {summary['rows_flagged']} flagged "
              f"(max |Δ| > {args.threshold:g}),"
              f" {summary['rows_skipped']} skipped; max |Δ| {summary['max_abs_delta']:.2e}, mean |Δ| "
              f"{summary['mean_abs_delta']:.2e}, KL {summary['kl']:.2e}")  # fmt: skip
    return 1 if report.flagged else 0


def _tokenizer_spec(spec: str) -> tuple[str, str]:
    """``NAME`` (a built-in model, or a directory) or ``NAME=DIR``: a served name and its tokenizer's directory."""
    from stream_gateway.models import resolve_model

    name, _, where = spec.partition("=")
    path = resolve_model(where or name)
    if not Path(path).is_dir():
        raise ValueError(f"--model {spec!r}: no local directory (the console reads tokenizers from disk only)")
    return name, path


def console_tokenizers(settings: Settings, model_name: str) -> dict[str, str]:
    """The served model's tokenizer directory for ``up``'s console (none for a hub id it would download)."""
    from stream_gateway.models import resolve_model

    path = resolve_model(settings.model, settings.model_cache_dir)  # built already: the engine loaded it
    return {model_name: path} if Path(path).is_dir() else {}


def _reward_or_none(text: str) -> float | None:
    if text.lower() == "none":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a number, or none") from None


def _moment(text: str) -> float:
    """A point in time: ISO 8601 (a time without a zone is UTC) or Unix seconds."""
    from datetime import datetime

    try:
        return float(text)
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a time as ISO 8601 or Unix seconds") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


def parser() -> argparse.ArgumentParser:
    """The ``stream-gateway`` command, every subcommand on it."""
    command = argparse.ArgumentParser(prog="stream-gateway", description=__doc__.split("\n\n")[0].replace("``", ""))
    commands = command.add_subparsers(dest="command", required=True)

    up_command = commands.add_parser(
        "up", help="embedded NATS + the gateway capturing into it, on this machine", epilog=ENVIRONMENT_NOTE
    )
    add_gateway_flags(up_command, exclude=_SET_BY_UP)
    up_command.add_argument("--data-dir", help="NATS store and outbox (default ~/.local/state/stream-gateway/up)")
    up_command.add_argument("--nats-port", type=int, default=4222, help="embedded NATS port (default 4222; 0: any)")
    up_command.add_argument("--nats-monitor-port", type=int, default=8222, help="its HTTP monitor port (default 8222)")
    # up is where traffic first becomes training data: plain sessions (no close, no feedback) reach a
    # batch in minutes rather than never (issue 43); `assemble` keeps 900 s and no default reward.
    up_command.add_argument("--idle-timeout", type=float, default=120.0,
                            help="assembler: a session not closed ends its trajectories after this long idle "
                            "(default 120 s here; assemble's is 900)")  # fmt: skip
    up_command.add_argument("--default-reward", type=_reward_or_none, default=0.0,
                            help="assembler: reward of sessions with no feedback (default 0.0 here, so plain "
                            "traffic becomes batches; 'none' drops them, as assemble does); the banner says "
                            "which applies")  # fmt: skip
    up_command.add_argument("--reward-function", help="assembler: module:function computing a reward per trajectory")
    up_command.add_argument("--console-port", type=int, default=8001,
                            help="the trajectory console's port (default 8001; 0: no console)")  # fmt: skip
    consumers.cli.add_batch_flags(up_command)
    consumers.cli.add_trajectories_max_age_flag(up_command)
    consumers.cli.add_scorer_flags(up_command)  # with --scorer, up runs the reward worker (docs/rewards.md)
    up_command.add_argument("--reward-metrics-port", type=int, default=8002,
                            help="the reward worker's /metrics port, with --scorer (default 8002; 0: off)")  # fmt: skip
    up_command.set_defaults(run=_up_command)

    forget_command = commands.add_parser(
        "forget", help="erase a session or a tenant from every store, for good (docs/data-rights.md)"
    )
    add_nats_arguments(forget_command)
    forget_command.add_argument("--session", metavar="ID", help="the session to forget (with --tenant: of that tenant)")
    forget_command.add_argument("--tenant", metavar="NAME", help="the tenant (its key file name, or its key) or, "
                                "alone, every session of it")  # fmt: skip
    forget_command.add_argument("--batches-dir", action="append", metavar="DIR",
                                help="parquet batch files on this machine to rewrite too (repeatable)")  # fmt: skip
    forget_command.add_argument(
        "--before",
        type=_moment,
        metavar="TIME",
        help="only the sessions that began before TIME (ISO 8601, e.g. 2026-10-01T00:00:00Z, or Unix seconds), whole",
    )
    forget_command.add_argument(
        "--grace", type=float, default=1.0, help="seconds for the gateways to learn the tombstone (default 1)"
    )
    forget_command.set_defaults(run=_forget_command)

    console_command = commands.add_parser(
        "console", help="the trajectory console: sessions, turn trees and tokens as training sees them, in a browser"
    )
    add_nats_arguments(console_command)
    console_command.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    console_command.add_argument("--port", type=int, default=8001, help="port (default 8001)")
    console_command.add_argument("--index", default=str(default_data_dir().parent / "console.sqlite"),
                                 help="its SQLite index, rebuilt from the streams when missing (default "
                                 "~/.local/state/stream-gateway/console.sqlite; :memory: for none)")  # fmt: skip
    console_command.add_argument("--api-key", action="append", help="a key accepted, as the gateway's (repeatable)")
    console_command.add_argument("--api-key-file", help="the gateway's key file (tenants)")
    console_command.add_argument("--admin-api-key", action="append", help="a key that sees every tenant and may forget")
    console_command.add_argument("--model", action="append", metavar="NAME[=DIR]",
                                 help="a served model's tokenizer, to show text "
                                 "(repeatable; a built-in name or NAME=DIR)")  # fmt: skip
    console_command.add_argument("--batches-dir", action="append", metavar="DIR",
                                 help="parquet batch files a forget from the console rewrites too "
                                 "(repeatable)")  # fmt: skip
    console_command.add_argument("--gateway-url", metavar="URL",
                                 help="a gateway (http://host:port) whose feedback route takes the ratings people "
                                 "give in the console, with their own keys (unset: no rating)")  # fmt: skip
    console_command.add_argument("--events-stream", default="SG_EVENTS", help="the events stream (default SG_EVENTS)")
    console_command.add_argument("--subject-prefix", default="sg", help="first token of subjects (default sg)")
    console_command.set_defaults(run=_console_command)

    verify_command = commands.add_parser(
        "verify", help="recompute a batch's logprobs with a checkpoint: rollout-vs-trainer mismatch per row"
    )
    verify_command.add_argument("batch", help="a batch's parquet file (the batcher's --output-dir, or up's batches)")
    verify_command.add_argument("--model", required=True, help="the checkpoint: a built-in name or a directory")
    verify_command.add_argument("--rows", type=int, help="check this many rows, picked at random (default all)")
    verify_command.add_argument("--threshold", type=float, default=0.05,
                                help="flag a row whose largest |Δ logprob| passes this "
                                "(nats, default 0.05)")  # fmt: skip
    verify_command.add_argument("--temperature", type=float, default=1.0, help="the trainer's temperature (default 1)")
    verify_command.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                                help="the forward pass's dtype (default float32)")  # fmt: skip
    verify_command.add_argument("--seed", type=int, default=0, help="which rows --rows picks")
    verify_command.add_argument("--format", choices=("table", "json"), default="table",
                                help="the report as a table (default) or as JSON")  # fmt: skip
    verify_command.set_defaults(run=_verify_command)

    stream_gateway.cli.add_commands(commands)
    pipeline.cli.add_commands(commands)
    consumers.cli.add_commands(commands)
    return command


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``stream-gateway`` console script."""
    args = parser().parse_args(argv)
    if args.command in ("up", "serve", "prepare-model", "forget", "console", "verify"):
        result: int = args.run(args)
        return result
    return pipeline.cli.run_command(args)


if __name__ == "__main__":
    raise SystemExit(main())
