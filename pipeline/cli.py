"""The pipeline's commands: ``tail`` (watch events) and ``publish-weights`` (a new policy version).

:func:`add_commands` registers them on the ``stream-gateway`` command (:mod:`stream_stack.cli`);
``python -m pipeline.cli`` runs them alone. Both take the shared NATS options of
:mod:`pipeline.connection` (URLs, credentials, TLS). :func:`add_stream_replicas_flag` is the
``--stream-replicas`` of the commands that provision streams beside the gateway's (``publish-weights``,
``assemble``, ``batch``): unset, unlike the gateway's, it changes no existing stream's replicas.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .connection import NatsAuth, add_nats_arguments, nats_auth_from_args, split_servers
from .streams import MAX_REPLICAS

__all__ = [
    "add_commands",
    "add_stream_replicas_flag",
    "main",
    "nats_from_args",
    "progress",
    "run_command",
    "standalone",
]


def progress(message: str) -> None:
    """One line of progress on stderr, as every ``stream-gateway`` command writes it."""
    print(f"stream-gateway: {message}", file=sys.stderr, flush=True)


def nats_from_args(args: argparse.Namespace, command: str) -> tuple[tuple[str, ...], NatsAuth] | None:
    """The servers and credentials of a command's NATS flags; ``None`` (said on stderr) if they are unusable."""
    try:
        return split_servers(args.nats_url), nats_auth_from_args(args)
    except ValueError as exc:
        print(f"stream-gateway {command}: {exc}", file=sys.stderr)
        return None


def _replica_count(text: str) -> int:
    try:
        count = int(text)
    except ValueError:
        count = 0
    if not 1 <= count <= MAX_REPLICAS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of replicas from 1 to {MAX_REPLICAS}")
    return count


def add_stream_replicas_flag(command: argparse.ArgumentParser, what: str) -> None:
    """``--stream-replicas N`` (``args.stream_replicas``, ``None`` when not given), replicas of ``what``.

    Unset, what is missing is created with one replica and what exists keeps its count: a command
    that shares a stream with the gateways must not scale it down (:mod:`pipeline.streams`).
    """
    command.add_argument(
        "--stream-replicas",
        type=_replica_count,
        metavar="STREAM_REPLICAS",
        help=f"replicas of {what} on a NATS cluster, 1-{MAX_REPLICAS}, as the gateways' --stream-replicas "
        "(unset: one for what is created; what exists keeps its count)",
    )


def _tail(args: argparse.Namespace) -> int:
    import anyio

    from pipeline.errors import TailError

    from .streams import StreamSpec
    from .tail import TailFilter, tail_events

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
    if (nats := nats_from_args(args, "tail")) is None:
        return 2
    servers, auth = nats
    spec = StreamSpec(prefix=args.subject_prefix, stream=args.events_stream)
    color = sys.stdout.isatty() and not args.no_color

    def write(line: str) -> None:
        print(line, flush=True)

    async def run() -> int:
        return await tail_events(list(servers), spec, flt, write, limit=args.limit, color=color, auth=auth)

    try:
        with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how one stops watching
            anyio.run(run)
    except TailError as exc:
        print(f"stream-gateway tail: {exc}", file=sys.stderr)
        return 1
    return 0


def _publish_weights(args: argparse.Namespace) -> int:
    import anyio

    from pipeline.errors import NatsRefused, StalePolicyVersion

    from .connection import connect
    from .policies import publish_policy
    from .streams import StreamSpec

    if (nats := nats_from_args(args, "publish-weights")) is None:
        return 2
    servers, auth = nats
    spec = StreamSpec(prefix=args.subject_prefix, stream=args.events_stream, replicas=args.stream_replicas)
    if not Path(args.directory).is_dir():
        print(f"stream-gateway publish-weights: no directory {args.directory}", file=sys.stderr)
        return 2
    if args.adapter is not None and args.partial:
        print("stream-gateway publish-weights: --partial: an adapter version is always whole", file=sys.stderr)
        return 2

    async def run() -> int:
        try:
            nc = await connect(servers, auth, name="stream-gateway-publish-weights", connect_timeout=5)
        except NatsRefused as exc:
            print(f"stream-gateway publish-weights: {exc}", file=sys.stderr)
            return 1
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
                progress=progress,
                adapter=args.adapter,
            )
        except StalePolicyVersion as exc:
            print(f"stream-gateway publish-weights: {exc}", file=sys.stderr)
            return 2
        finally:
            await nc.close()
        total = sum(o.size for o in event.objects)
        what = f"adapter {event.adapter} version" if event.adapter is not None else "policy"
        progress(
            f"published {what} {event.policy_version} ({len(event.objects)} files, {total / 2**20:.1f} MiB, "
            f"{'full' if event.full else 'partial'}) as event {event.event_id}"
        )
        return 0

    try:
        return anyio.run(run)
    except (FileNotFoundError, ValueError) as exc:
        print(f"stream-gateway publish-weights: {exc}", file=sys.stderr)
        return 2


def add_commands(commands: Any) -> None:
    """Register ``tail`` and ``publish-weights`` on an ``add_subparsers()`` object."""
    tail = commands.add_parser("tail", help="watch events as they are published")
    add_nats_arguments(tail)
    tail.add_argument("--session", help="only this session id")
    tail.add_argument("--tenant", help="only this tenant (as it appears in events)")
    tail.add_argument("--kind", action="append", dest="kinds", help="only this kind, e.g. turn.completed (repeatable)")
    tail.add_argument("--live", action="store_true", help="also show live token deltas")
    tail.add_argument("--from-start", action="store_true", help="replay the stream from its first event")
    tail.add_argument("--limit", type=int, help="stop after this many events")
    tail.add_argument("--events-stream", default="SG_EVENTS", help="the events stream (default SG_EVENTS)")
    tail.add_argument("--subject-prefix", default="sg", help="first token of event subjects (default sg)")
    tail.add_argument("--no-color", action="store_true", help="plain text even on a terminal")
    tail.set_defaults(run=_tail)

    publish = commands.add_parser(
        "publish-weights", help="publish a safetensors checkpoint as a new policy version to every gateway"
    )
    publish.add_argument(
        "directory",
        help="a directory of *.safetensors files (a whole HF state dict, or a part); with --adapter a PEFT "
        "adapter directory (adapter_config.json + adapter_model.safetensors)",
    )
    publish.add_argument("--policy-version", type=int, required=True, help="the new version (above the current)")
    publish.add_argument(
        "--adapter",
        metavar="NAME",
        help="publish DIR as this version of the LoRA adapter NAME (versions per adapter; a new name adds one)",
    )
    add_nats_arguments(publish)
    publish.add_argument("--partial", action="store_true", help="the files hold only the tensors that changed")
    publish.add_argument("--bucket", default="sg_policies", help="the object store bucket (default sg_policies)")
    publish.add_argument("--keep", type=int, default=2, help="full versions kept in the bucket (default 2)")
    publish.add_argument("--events-stream", default="SG_EVENTS", help="the events stream (default SG_EVENTS)")
    publish.add_argument("--subject-prefix", default="sg", help="first token of subjects (default sg)")
    add_stream_replicas_flag(publish, "the events stream and the bucket")
    publish.set_defaults(run=_publish_weights)


def run_command(args: argparse.Namespace) -> int:
    """Run a parsed command whose handler takes the namespace (quiet logging: warnings up)."""
    logging.basicConfig(level="WARNING", format="%(levelname)s %(name)s: %(message)s")
    result: int = args.run(args)
    return result


def standalone(description: str, add: Any, argv: Sequence[str] | None) -> int:
    """A package's own ``python -m <package>.cli``: its commands (``add`` registers them) alone."""
    parser = argparse.ArgumentParser(prog="stream-gateway", description=description)
    add(parser.add_subparsers(dest="command", required=True))
    return run_command(parser.parse_args(argv))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pipeline.cli tail|publish-weights ...``."""
    return standalone(__doc__.split("\n\n")[0], add_commands, argv)


if __name__ == "__main__":
    raise SystemExit(main())
