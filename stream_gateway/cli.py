"""The gateway's commands: ``serve`` and ``prepare-model``.

* ``serve``: the OpenAI-compatible gateway on one engine; ``--nats-url`` captures its events
  to an existing NATS server or cluster (credentials and TLS: :mod:`pipeline.connection`).
* ``prepare-model``: build or convert a local model (``tiny``, ``tiny-agent``, ``tiny-reasoning``,
  ``tiny-moe``, ``tiny-vl``, ``smollm2``) and print its path.

:func:`add_commands` registers them on the ``stream-gateway`` command, which
:mod:`stream_stack.cli` composes with the pipeline's and the consumers' commands and ``up``;
``python -m stream_gateway.cli`` runs them alone. The gateway never imports the consumers.

The flags are not written here: :func:`add_gateway_flags` makes one per :class:`Settings` field,
so that a setting's name, type, default and help are written once, on the field. ``up`` runs
workers with the :mod:`stream_gateway._workers` names re-exported here (that module stays private).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
from collections.abc import Collection, Sequence
from dataclasses import fields
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

from pipeline.cli import progress
from pipeline.connection import NatsAuth, add_nats_arguments
from pydantic.fields import FieldInfo

from stream_gateway._errors import WorkersRefused
from stream_gateway._settings import WITHOUT_FLAG, Flag, Settings
from stream_gateway._workers import check_workers, listening_socket, run_workers
from stream_gateway.engines import build_engine

__all__ = [
    "ENVIRONMENT_NOTE",
    "WorkersRefused",
    "add_commands",
    "add_gateway_flags",
    "check_workers",
    "configure_logging",
    "main",
    "refusal",
    "run_until_interrupted",
    "run_workers",
    "serve",
    "settings_from_args",
    "uvicorn_options",
]

ENVIRONMENT_NOTE = (
    "Every gateway setting is also an environment variable, STREAM_GATEWAY_ and its name "
    "(--max-batch-size: STREAM_GATEWAY_MAX_BATCH_SIZE=32, --no-live-deltas: STREAM_GATEWAY_LIVE_DELTAS=false, "
    '--api-key: STREAM_GATEWAY_API_KEYS=\'["k1", "k2"]\'); a flag wins over it.'
)


def serve(settings: Settings) -> int:
    import uvicorn

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
    _declare_asyncio()
    if settings.worker_index is None:
        uvicorn.run(app, **uvicorn_options(settings))
        return 0
    # A worker of --workers N: the port is shared with the other workers (SO_REUSEPORT).
    sock = listening_socket(settings.host, settings.port, reuse_port=True)
    server = uvicorn.Server(uvicorn.Config(app, **uvicorn_options(settings)))
    server.run(sockets=[sock])
    return 0


def _declare_asyncio() -> None:
    """Tell sniffio that the loop about to run (uvicorn's) is asyncio's, as ``anyio.run`` does.

    anyio asks sniffio which library is running for every ``Event``, ``Lock`` and timeout it makes
    (anyio 4.16, sniffio 1.3.1: read); told nothing, sniffio looks for the current asyncio task
    each time: ~5% of a capturing request's CPU (``benchmarks/request_steps.py --capture``). The
    loop's tasks and callbacks inherit this context's value."""
    try:
        import sniffio
    except ImportError:  # anyio then asks asyncio directly
        return
    sniffio.current_async_library_cvar.set("asyncio")


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """uvicorn's options for the gateway: address, log level, event loop and HTTP parser."""
    loop, http = settings.server_stack()
    return {
        "host": settings.host,
        "port": settings.port,
        "log_level": settings.log_level,
        "loop": loop,
        "http": http,
        # Streams in flight get --shutdown-grace-seconds, then end with an error frame (http/_sse.py);
        # uvicorn cuts what is left after that (a non-streamed answer, a client that reads nothing).
        "timeout_graceful_shutdown": settings.shutdown_grace_seconds + 10,
    }


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


_NATS_GROUP = frozenset({"nats_url", *(f"nats_{f.name}" for f in fields(NatsAuth))})
"""Settings whose flags are :func:`~pipeline.connection.add_nats_arguments`' group, which every command
that connects to NATS shares: ``serve`` adds that group rather than making these flags again."""


def add_gateway_flags(
    command: argparse.ArgumentParser, *, only: Collection[str] | None = None, exclude: Collection[str] = ()
) -> None:
    """One flag per setting (``only`` those, less ``exclude``), made from its :class:`Settings` field.

    ``--field-name`` (or the field's :class:`~stream_gateway._settings.Flag` name), its description as
    the help, with the default; a boolean is the one switch that changes its default (``--x`` when
    off, ``--no-x`` when on); a tuple is a repeatable flag; a ``Literal`` or a ``Flag``'s choices are
    the accepted values. Every flag defaults to unset, so that an unset flag leaves the setting to
    ``STREAM_GATEWAY_*`` and then to the field's default. Not made here: :data:`WITHOUT_FLAG`, and
    the NATS options, which :func:`~pipeline.connection.add_nats_arguments` adds.
    """
    for name, field in Settings.model_fields.items():
        if name in WITHOUT_FLAG or name in _NATS_GROUP or name in exclude or (only is not None and name not in only):
            continue
        flag, options = _flag(name, field)
        command.add_argument(flag, dest=name, **options)


def _flag(name: str, field: FieldInfo) -> tuple[str, dict[str, Any]]:
    """The flag of setting ``name`` and its ``add_argument`` options."""
    marks = next((m for m in field.metadata if isinstance(m, Flag)), Flag())
    flag = marks.name or "--" + name.replace("_", "-")
    kind, values = _kind(field.annotation)
    default = field.get_default()
    meaning = (field.description or "").replace("%", "%%")  # argparse formats help with %
    if kind is bool:
        if default is True:
            return "--no-" + flag.removeprefix("--"), {
                "action": "store_const",
                "const": False,
                "help": f"turn off (on by default): {meaning}",
            }
        return flag, {"action": "store_const", "const": True, "help": meaning}
    options: dict[str, Any] = {}
    if kind is tuple:
        options["action"] = "append"
        meaning += " (repeatable)"
    elif kind in (int, float):
        options["type"] = kind
    if marks.choices is not None:
        values = tuple(marks.choices())
    if values:
        options["choices"] = values
    else:
        options["metavar"] = flag.removeprefix("--").replace("-", "_").upper()  # a list's flag names one item
    if default not in (None, ()):
        meaning += f" (default: {default:g})" if isinstance(default, float) else f" (default: {default})"
    options["help"] = meaning
    return flag, options


def _kind(annotation: Any) -> tuple[Any, tuple[str, ...]]:
    """A setting's type as its flag sees it (``None`` aside), and a ``Literal``'s values."""
    args = [a for a in get_args(annotation) if a is not type(None)]
    if get_origin(annotation) in (Union, UnionType) and len(args) == 1:
        return _kind(args[0])
    if get_origin(annotation) is Literal:
        return str, tuple(str(a) for a in args)
    if get_origin(annotation) is tuple and args[1:] == [Ellipsis]:
        return tuple, ()
    if annotation in (bool, int, float, str, Path):
        return annotation, ()
    raise TypeError(
        f"no flag for a setting of type {annotation!r}: teach stream_gateway.cli._kind, or list it in WITHOUT_FLAG"
    )


def _exposure_refusal(settings: Settings) -> str | None:
    """Why these settings must not serve: an unreadable key file, or no keys on a public address."""
    import ipaddress

    from stream_gateway.control import read_key_file

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


def settings_from_args(args: argparse.Namespace) -> Settings:
    """The gateway's settings from a command's flags (unset flags: environment, then defaults).

    Only the namespace's settings are read: a command's other flags (``up``'s) are its own business.
    """
    given = {name: value for name in Settings.model_fields if (value := getattr(args, name, None)) is not None}
    return Settings(**given)


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
    serve = commands.add_parser("serve", help="run the OpenAI-compatible gateway", epilog=ENVIRONMENT_NOTE)
    add_gateway_flags(serve)
    add_nats_arguments(serve, url_default=None)
    serve.set_defaults(run=_serve_command)

    prepare = commands.add_parser("prepare-model", help="build/convert a local model and print its path")
    add_gateway_flags(prepare, only=("model", "model_cache_dir"))
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
