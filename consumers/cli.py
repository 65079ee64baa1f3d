"""The consumers' commands: ``assemble`` (events → trajectories), ``reward`` (trajectories → scores),
``batch`` (→ verl batches), ``flush`` (the running batcher emits what it holds) and ``pending``
(what each session waits for).

:func:`add_commands` registers them on the ``stream-gateway`` command (:mod:`stream_stack.cli`);
``python -m consumers.cli`` runs them alone. Both take the shared NATS options of
:mod:`pipeline.connection` (URLs, credentials, TLS). :func:`add_batch_flags`, :func:`batcher_config`,
:func:`add_scorer_flags` and :func:`reward_worker_config` also serve ``stream-gateway up``, which runs
the consumers in-process.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.cli import add_stream_replicas_flag, nats_from_args, progress, standalone
from pipeline.connection import NatsAuth, add_nats_arguments
from pipeline.errors import NatsRefused

from .streams import ConsumerStreams

if TYPE_CHECKING:
    import anyio

    from .batcher import BatcherConfig
    from .reward_worker import RewardWorkerConfig

__all__ = [
    "add_batch_flags",
    "add_commands",
    "add_scorer_flags",
    "add_trajectories_max_age_flag",
    "batcher_config",
    "main",
    "reward_worker_config",
]


def _assemble(args: argparse.Namespace) -> int:

    from .assembler import AssemblerConfig, run_assembler

    if (nats := nats_from_args(args, "assemble")) is None:
        return 2
    servers, auth = nats
    config = AssemblerConfig(
        servers=servers,
        auth=auth,
        names=ConsumerStreams(
            prefix=args.subject_prefix,
            events=args.events_stream,
            replicas=args.stream_replicas,
            trajectories_max_age_s=args.trajectories_max_age_seconds,
        ),
        durable=args.durable,
        idle_timeout_s=args.idle_timeout,
        close_grace_s=args.close_grace,
        reward_wait_s=args.reward_wait,
        default_reward=args.default_reward,
        reward_function=args.reward_function,
        reward_timeout_s=args.reward_timeout,
        aborted=args.aborted,
        shared_turns=args.shared_turns,
        max_turns=args.max_turns,
        max_tokens=args.max_tokens,
        ack_wait_s=args.ack_wait,
    )
    progress(f"assembler {config.durable!r} reading {config.names.events} at {args.nats_url}")
    return _run_consumer("assemble", run_assembler, config)


def batcher_config(
    args: argparse.Namespace,
    servers: tuple[str, ...],
    auth: NatsAuth,
    output_dir: Path | None,
    *,
    replicas: int | None = None,
    **more: Any,
) -> BatcherConfig:
    """The batcher's configuration from :func:`add_batch_flags`' flags (and ``more`` fields).

    ``replicas``: of its streams and buckets (``ConsumerStreams.replicas``): ``batch``'s
    ``--stream-replicas``, ``up``'s one server's 1; ``None`` changes no existing count.
    """
    from .batcher import BatcherConfig

    names = ConsumerStreams(
        prefix=args.subject_prefix or "sg",
        events=args.events_stream or "SG_EVENTS",
        replicas=replicas,
        batches_max_age_s=args.batches_max_age_seconds,
    )
    return BatcherConfig.of(
        **more,
        servers=servers,
        auth=auth,
        names=names,
        batch_size=args.batch_size,
        group_size=args.group_size,
        group_key=args.group_key,
        max_staleness=args.max_staleness,
        prompt_length=args.prompt_length,
        response_length=args.response_length,
        overlong=args.overlong,
        no_reward=args.no_reward,
        unfinished=args.unfinished,
        overlong_penalty=args.overlong_penalty,
        only_adapter=args.adapter,
        only_base=args.base,
        output_dir=output_dir,
        parquet_max_age_s=args.parquet_max_age_seconds or 0.0,
        reward=args.reward,
        await_scorers=tuple(args.await_scorer or ()),
    )


def _batch(args: argparse.Namespace) -> int:
    from .batcher import run_batcher

    if (nats := nats_from_args(args, "batch")) is None:
        return 2
    servers, auth = nats
    output_dir = Path(args.output_dir).expanduser() if args.output_dir else None
    try:
        config = batcher_config(
            args, servers, auth, output_dir, replicas=args.stream_replicas, ack_wait_s=args.ack_wait
        )
    except ValueError as exc:
        print(f"stream-gateway batch: {exc}", file=sys.stderr)
        return 2
    where = f", parquet files in {output_dir}" if output_dir else ""
    only = "" if config.adapters is None else f" of {config.adapters} only (consumer {config.consumer_name})"
    progress(
        f"batcher: batches of {config.grouping.batch_size} (groups of {config.grouping.group_size}){only} "
        f"from {args.nats_url}{where}"
    )
    if config.reward is not None:
        awaited = ", ".join(f"{name} up to {seconds:g} s" for name, seconds in config.await_scorers) or "none"
        progress(f"batcher: reward = {config.reward} (the reward worker's scores); awaited: {awaited}")
        if not config.await_scorers and config.grouping.no_reward == "drop":
            progress("batcher: a trajectory with no reward of its own (feedback, --default-reward) that comes "
                     "before its scores is dropped: add --await-scorer NAME:SECONDS to wait for them")  # fmt: skip
    return _run_consumer("batch", run_batcher, config)


def reward_worker_config(
    args: argparse.Namespace,
    servers: tuple[str, ...],
    auth: NatsAuth,
    names: ConsumerStreams,
    *,
    tokenizers: dict[str, str] | None = None,
    **more: Any,
) -> RewardWorkerConfig:
    """The reward worker's configuration from :func:`add_scorer_flags`' flags (``ValueError`` if they
    do not make one); ``tokenizers`` (``up``'s model) when ``--tokenizer`` gives none."""
    from dataclasses import replace

    from .reward_worker import RewardWorkerConfig
    from .scorers import Scorer, parse_scorer

    specs = [parse_scorer(text) for text in args.scorer or ()]
    for spec in specs:  # a Python scorer that cannot be imported is refused now, not at the first trajectory
        if spec.kind == "python":
            try:
                Scorer.python(spec)
            except ImportError as exc:
                raise ValueError(f"--scorer {spec.name}: {exc}") from None
    known = {spec.name for spec in specs}
    limits: dict[str, dict[str, Any]] = {spec.name: {} for spec in specs}
    for flag, field, kind in (("scorer_timeout", "timeout_s", float), ("scorer_concurrency", "concurrency", int),
                              ("scorer_retries", "retries", int)):  # fmt: skip
        for text in getattr(args, flag) or ():
            name, equals, value = text.rpartition("=")
            if equals and name not in known:
                raise ValueError(f"--{flag.replace('_', '-')} {text!r}: no scorer {name!r}")
            for target in [name] if equals else known:
                limits[target][field] = kind(value)
    given = dict(_tokenizer(text) for text in args.tokenizer or ())
    return RewardWorkerConfig(
        servers=servers,
        auth=auth,
        names=names,
        scorers=tuple(replace(spec, **limits[spec.name]) for spec in specs),
        tokenizers=given or dict(tokenizers or {}),
        judge_template=args.judge_template,
        judge_api_key=args.judge_api_key,
        **more,
    )


def _tokenizer(text: str) -> tuple[str, str]:
    """``[MODEL=]DIR``: the model it serves (``""``: every model) and the directory."""
    model, equals, where = text.partition("=")
    return (model, where) if equals else ("", text)


def _reward(args: argparse.Namespace) -> int:
    """``stream-gateway reward``: one replica of the reward worker."""
    from .reward_worker import run_reward_worker

    if (nats := nats_from_args(args, "reward")) is None:
        return 2
    servers, auth = nats
    names = ConsumerStreams(prefix=args.subject_prefix, events=args.events_stream, replicas=args.stream_replicas)
    try:
        config = reward_worker_config(
            args, servers, auth, names, durable=args.durable, ack_wait_s=args.ack_wait,
            max_in_flight=args.max_in_flight, metrics_host=args.metrics_host, metrics_port=args.metrics_port,
        )  # fmt: skip
    except (ValueError, OSError) as exc:
        print(f"stream-gateway reward: {exc}", file=sys.stderr)
        return 2
    scorers = ", ".join(f"{spec.name} ({spec.spec})" for spec in config.scorers)
    progress(f"rewarder {config.durable!r} ({config.worker}) on {names.trajectories} at {args.nats_url}: {scorers}")
    return _run_consumer("reward", run_reward_worker, config)


def _flush(args: argparse.Namespace) -> int:
    """``stream-gateway flush``: ask the batcher for the partial batch it holds, print its answer."""
    import anyio
    import nats.errors
    import orjson
    from pipeline.connection import connect

    from .streams import ConsumerStreams

    if (given := nats_from_args(args, "flush")) is None:
        return 2
    servers, auth = given
    subject = ConsumerStreams(prefix=args.subject_prefix).flush_subject

    async def ask() -> int:
        nc = await connect(servers, auth, name="stream-gateway-flush", max_reconnect_attempts=1)
        try:
            reply = await nc.request(subject, b"", timeout=args.timeout)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
            print(f"stream-gateway flush: no batcher answered on {subject} (is one running?)", file=sys.stderr)
            return 1
        finally:
            await nc.close()
        answer = orjson.loads(reply.data)
        print(f"batcher: {answer['batches']} batches emitted; still held: {answer['held']} trajectories "
              f"({answer['open_groups']} groups not yet whole)")  # fmt: skip
        return 0

    return int(anyio.run(ask))


def _pending(args: argparse.Namespace) -> int:
    """``stream-gateway pending``: what the running assemblers and batchers wait for, per session."""
    import anyio
    import orjson
    from pipeline.connection import connect

    from .streams import ConsumerStreams

    if (given := nats_from_args(args, "pending")) is None:
        return 2
    servers, auth = given
    subject = ConsumerStreams(prefix=args.subject_prefix).pending_subject

    async def ask() -> list[dict[str, Any]]:
        nc = await connect(servers, auth, name="stream-gateway-pending", max_reconnect_attempts=1)
        try:
            inbox = nc.new_inbox()
            answers = await nc.subscribe(inbox)
            await nc.publish(subject, b"", reply=inbox)
            found: list[dict[str, Any]] = []
            with anyio.move_on_after(args.timeout):  # every assembler and batcher answers; gather for a while
                async for msg in answers.messages:
                    found.append(orjson.loads(msg.data))
            return found
        finally:
            await nc.close()

    answers = anyio.run(ask)
    if not answers:
        print(f"stream-gateway pending: no assembler or batcher answered on {subject}", file=sys.stderr)
        return 1
    for answer in answers:
        if answer["role"] == "assembler":
            for s in answer["sessions"]:
                default = s["reward_if_none"]
                reward = "none, dropped" if default is None else f"{default:g}"
                reward = "" if s["feedback"] else f"; no feedback: reward {reward}"
                print(f"session {s['session_id']}: {s['turns']} turns, {'closed' if s['closed'] else 'open'}, "
                      f"waiting for {s['waiting_for']} (at most {s['due_in_s']:g} s more){reward}")  # fmt: skip
            if not answer["sessions"]:
                print("assembler: no session waiting")
        else:
            print(f"batcher: {answer['held']} trajectories held ({answer['open_groups']} groups not yet whole, "
                  f"groups of {answer['group_size']}); a batch takes {answer['batch_size']} "
                  f"(stream-gateway flush makes one now); {answer['batches']} batches so far")  # fmt: skip
            if (scores := answer.get("scores")) is not None:
                waits = ", ".join(f"{name}: {n}" for name, n in scores["scorers"].items())
                print(f"batcher: reward = {scores['reward']}; {scores['trajectories']} trajectories waiting for "
                      f"scores" + (f" ({waits}; at most {scores['due_in_s']:g} s more)" if waits else ""))  # fmt: skip
    return 0


# After SIGINT or SIGTERM, how long a consumer's cancelled work may take to wind down before the
# process exits anyway: what it had not acknowledged is delivered again, so nothing durable is lost.
_STOP_GRACE_S = 15.0


def _run_consumer(command: str, run: Any, config: Any) -> int:
    """Run a consumer until SIGINT or SIGTERM (exit status 0); a server refusing its credentials ends
    it with exit status 1.

    The signals are read by the event loop and cancel the consumer's tasks. Python's default
    KeyboardInterrupt lands wherever the main thread happens to be, inside a library's cleanup too:
    a reward worker was once left running for minutes after a SIGINT that way.
    """
    import anyio

    async def until_signalled() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_stop_on_signal, tg.cancel_scope, command)
            await run(config, progress)
            tg.cancel_scope.cancel()

    try:
        with contextlib.suppress(KeyboardInterrupt):  # a signal before the loop reads them
            anyio.run(until_signalled)
    except NatsRefused as exc:
        print(f"stream-gateway {command}: {exc}", file=sys.stderr)
        return 1
    return 0


async def _stop_on_signal(scope: anyio.CancelScope, command: str) -> None:
    """Cancel ``scope`` at the first SIGINT or SIGTERM; exit the process if winding down hangs."""
    import os
    import signal
    import threading

    import anyio

    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            progress(f"{command}: {signal.Signals(signum).name}, stopping")
            deadline = threading.Timer(_STOP_GRACE_S, os._exit, (1,))
            deadline.daemon = True
            deadline.start()
            scope.cancel()
            return


def add_batch_flags(command: argparse.ArgumentParser) -> None:
    """The batcher's flags (``batch`` and ``up``)."""
    command.add_argument("--batch-size", type=int, default=16, help="trajectories per batch (default 16)")
    command.add_argument("--group-size", type=int, default=1, help="GRPO group size; batches hold whole groups")
    command.add_argument("--group-key", default="metadata:group", help="'metadata:<name>' or 'prompt'")
    command.add_argument("--max-staleness", type=int, help="drop samples this many policy versions old")
    command.add_argument("--prompt-length", type=int, default=1024, help="verl prompt length (longer: dropped)")
    command.add_argument("--response-length", type=int, default=2048, help="verl response length")
    command.add_argument("--overlong", choices=("truncate", "drop"), default="truncate", help="too-long responses")
    command.add_argument("--no-reward", choices=("drop", "zero"), default="drop", help="samples without a reward")
    command.add_argument("--overlong-penalty", type=int, metavar="TOKENS",
                         help="DAPO's soft over-long punishment: a response longer than --response-length minus "
                         "TOKENS loses up to 1 from its reward, linearly, all of it at --response-length")  # fmt: skip
    command.add_argument("--unfinished", choices=("keep", "drop", "mask"), default="keep",
                         help="samples whose last turn is unfinished (cut at max_tokens, or aborted): keep them, "
                         "drop them, or keep them with that turn out of the loss (default keep)")  # fmt: skip
    command.add_argument(
        "--batches-max-age-seconds",
        type=_seconds,
        help="retention: the batches stream and bucket keep a batch this long (unset: as they are; 0: forever)",
    )
    command.add_argument(
        "--parquet-max-age-seconds",
        type=_seconds,
        help="retention: parquet files in --output-dir older than this are deleted (unset or 0: never)",
    )
    command.add_argument("--reward", metavar="FORMULA",
                         help="a trajectory's reward from the reward worker's scores: a scorer (judge), a part of one "
                         "(tests.passed) or a weighted sum (0.7*judge+0.3*tests); reward_source names it. A "
                         "trajectory without every score keeps its own reward (feedback, default) flagged unscored; "
                         "a user's feedback wins (docs/rewards.md)")  # fmt: skip
    command.add_argument("--await-scorer", action="append", type=_awaited, metavar="NAME:SECONDS",
                         help="hold a trajectory for this scorer's record at most SECONDS after it was published "
                         "(repeatable; stream-gateway pending says what waits)")  # fmt: skip
    only = command.add_mutually_exclusive_group()
    only.add_argument("--adapter", metavar="NAME", help="only this LoRA adapter's trajectories (a consumer of its own)")
    only.add_argument("--base", action="store_true", help="only the base model's trajectories, none of an adapter's")


def add_trajectories_max_age_flag(command: argparse.ArgumentParser) -> None:
    """``--trajectories-max-age-seconds`` (``assemble`` and ``up``)."""
    command.add_argument(
        "--trajectories-max-age-seconds",
        type=_seconds,
        help="retention: the trajectories stream keeps a trajectory this long (unset: as it is; 0: forever)",
    )


def _awaited(text: str) -> tuple[str, float]:
    name, colon, seconds = text.rpartition(":")
    if not colon or not name:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME:SECONDS")
    return name, _seconds(seconds)


def add_scorer_flags(command: argparse.ArgumentParser) -> None:
    """The reward worker's scorers and their limits (``reward`` and ``up``)."""
    command.add_argument("--scorer", action="append", metavar="NAME=SPEC",
                         help="a scorer (repeatable): NAME=python:MODULE:FUNCTION, NAME=command:CMD (the trajectory "
                         "as JSON on stdin, a JSON number or object on stdout), NAME=judge:URL#MODEL (an "
                         "OpenAI-compatible /v1 asked for a score) or NAME=signals[:SIGNAL=WEIGHT,...] (the turns' "
                         "implicit signals: retried, edited, tool_error, abandoned, accepted); "
                         "docs/rewards.md")  # fmt: skip
    command.add_argument("--scorer-timeout", action="append", metavar="[NAME=]SECONDS",
                         help="time limit of one try (default 30 s; NAME=: that scorer only; repeatable)")  # fmt: skip
    command.add_argument(
        "--scorer-concurrency",
        action="append",
        metavar="[NAME=]N",
        help="tries of a scorer running at once (default 8)",
    )
    command.add_argument(
        "--scorer-retries",
        action="append",
        metavar="[NAME=]N",
        help="tries after a failed or timed-out one (default 1)",
    )
    command.add_argument("--judge-template", metavar="FILE",
                         help="a judge's prompt, with {transcript}, {prompt}, {last_answer}, {metadata} "
                         "(default: a score from 0 to 1 as JSON)")  # fmt: skip
    command.add_argument("--judge-api-key", help="the judges' API key (sent as a Bearer token)")
    command.add_argument(
        "--tokenizer",
        action="append",
        metavar="[MODEL=]DIR",
        help="a model's tokenizer, to give scorers the trajectory's text (a judge needs one)",
    )


def _seconds(text: str) -> float:
    value = float(text)
    if value < 0 or value != value:
        raise argparse.ArgumentTypeError(f"{text!r}: seconds, 0 or more")
    return value


def add_commands(commands: Any) -> None:
    """Register ``assemble``, ``reward``, ``batch``, ``flush`` and ``pending`` on an ``add_subparsers()`` object."""
    assemble = commands.add_parser("assemble", help="turn session events into trajectories (a durable consumer)")
    add_nats_arguments(assemble)
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
    assemble.add_argument("--shared-turns", choices=("once", "every"), default="once",
                          help="a sampled turn two chains share is trained once (in the first chain) or in every "
                          "chain holding it (default once)")  # fmt: skip
    assemble.add_argument("--max-turns", type=int, help="emit a session (truncated) at this many turns")
    assemble.add_argument("--max-tokens", type=int, help="cut trajectories at this many tokens")
    assemble.add_argument("--ack-wait", type=float, default=60.0, help="redelivery delay after a crash (s)")
    add_trajectories_max_age_flag(assemble)
    add_stream_replicas_flag(assemble, "the streams and buckets it provisions")
    assemble.set_defaults(run=_assemble)

    reward = commands.add_parser(
        "reward", help="score trajectories with programs, verifiers and LLM judges (replicas share the work)"
    )
    add_nats_arguments(reward)
    add_scorer_flags(reward)
    reward.add_argument("--durable", default="rewarder", help="consumer name; replicas with one name share work")
    reward.add_argument("--events-stream", default="SG_EVENTS", help="the events stream (default SG_EVENTS)")
    reward.add_argument("--subject-prefix", default="sg", help="first token of subjects (default sg)")
    reward.add_argument("--ack-wait", type=float, default=30.0,
                        help="a crashed replica's trajectories go to another after this long (default 30)")  # fmt: skip
    reward.add_argument("--max-in-flight", type=int, default=32, help="trajectories in hand at once (default 32)")
    reward.add_argument("--metrics-port", type=int, help="serve GET /metrics on this port (0: any free one)")
    reward.add_argument("--metrics-host", default="127.0.0.1", help="the address /metrics listens on")
    add_stream_replicas_flag(reward, "the streams and buckets it provisions")
    reward.set_defaults(run=_reward)

    batch = commands.add_parser("batch", help="group trajectories into verl training batches (a durable consumer)")
    add_nats_arguments(batch)
    batch.add_argument("--output-dir", help="also write each batch as <batch id>.parquet here")
    batch.add_argument("--events-stream", default="SG_EVENTS", help="the events stream (for policy.updated)")
    batch.add_argument("--subject-prefix", default="sg", help="first token of subjects (default sg)")
    batch.add_argument("--ack-wait", type=float, default=30.0, help="redelivery delay after a crash (s)")
    add_stream_replicas_flag(batch, "the streams and buckets it provisions")
    add_batch_flags(batch)
    batch.set_defaults(run=_batch)

    flush = commands.add_parser(
        "flush", help="have the running batcher emit what it holds now, as batches smaller than --batch-size"
    )
    add_nats_arguments(flush)
    flush.add_argument("--subject-prefix", default="sg", help="first token of subjects (default sg)")
    flush.add_argument("--timeout", type=float, default=30.0, help="how long to wait for the batcher's answer (s)")
    flush.set_defaults(run=_flush)

    pending = commands.add_parser("pending", help="what the running assembler and batcher wait for, session by session")
    add_nats_arguments(pending)
    pending.add_argument("--subject-prefix", default="sg", help="first token of subjects (default sg)")
    pending.add_argument("--timeout", type=float, default=2.0, help="how long to gather answers (s)")
    pending.set_defaults(run=_pending)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m consumers.cli assemble|reward|batch ...``."""
    return standalone(__doc__.split("\n\n")[0], add_commands, argv)


if __name__ == "__main__":
    raise SystemExit(main())
