"""The trajectory console: what will be trained on, in a browser (docs/console.md).

``stream-gateway console`` (and ``up``, on its own port) serves a page that reads the durable
stores through NATS, never a gateway's memory, so it shows every replica's sessions and is whole
after a restart: :mod:`._index` keeps a SQLite projection of the events, trajectories and batches
streams (:mod:`._feed` follows them), :mod:`._tokens` lays a trajectory's ids out as text with
their kinds, :mod:`._app` serves the page and its JSON, tenant-scoped by API key, and
:mod:`._ratings` sends a person's rating to the gateway's feedback route.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from consumers.streams import ConsumerStreams
from pipeline.connection import NatsAuth

from ._app import COOKIE, ConsoleApi, create_console_app
from ._feed import Feed
from ._index import ConsoleIndex, SessionFilter
from ._tokens import KINDS, Tokenizers, TokenView

__all__ = [
    "COOKIE",
    "KINDS",
    "ConsoleApi",
    "ConsoleConfig",
    "ConsoleIndex",
    "Feed",
    "SessionFilter",
    "TokenView",
    "Tokenizers",
    "create_console_app",
    "run_console",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ConsoleConfig:
    """Where the console reads and listens, and whose keys it accepts (the gateway's)."""

    servers: tuple[str, ...]
    index_path: Path | None  # the SQLite file; None: in memory (read from the streams at every start)
    host: str = "127.0.0.1"
    port: int = 8001
    auth: NatsAuth = field(default_factory=NatsAuth)
    names: ConsumerStreams = field(default_factory=ConsumerStreams)
    api_keys: tuple[str, ...] = ()
    api_key_file: Path | None = None
    admin_api_keys: tuple[str, ...] = ()
    tokenizers: dict[str, str] = field(default_factory=dict)  # served model name -> tokenizer directory
    batch_dirs: tuple[Path, ...] = ()  # parquet directories a forget rewrites (up's batches)
    gateway_url: str | None = None  # a gateway whose feedback route takes ratings (None: the console cannot rate)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/"


def _server_class() -> type:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server without its signal handlers: the process's owner (``up``, or
        ``run_until_interrupted``) stops it by cancelling, and one process has one set of handlers."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    return Server


async def run_console(config: ConsoleConfig, progress: Callable[[str], None] | None = None) -> None:
    """Follow the streams into the index and serve the console, until cancelled."""
    import anyio
    import uvicorn

    from pipeline.connection import connect

    _Server = _server_class()
    from stream_gateway.control import KeyRing, Limits

    index = ConsoleIndex(config.index_path)
    nc = await connect(config.servers, config.auth, name="stream-gateway-console")
    try:
        feed = Feed(nc, index, config.names)
        keyring = KeyRing(config.api_keys, config.api_key_file, Limits())
        api = ConsoleApi(index, feed, Tokenizers(config.tokenizers), keyring, config.admin_api_keys,
                         batch_dirs=config.batch_dirs, gateway_url=config.gateway_url)  # fmt: skip
        app = create_console_app(api)
        server = _Server(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning", lifespan="off"))
        async with anyio.create_task_group() as tg:
            tg.start_soon(feed.run)
            if progress is not None:
                progress(f"console: {config.url}")
            try:
                await server.serve()
            finally:
                server.should_exit = True
                for listening in getattr(server, "servers", ()):  # cancelled in its main loop: not shut down
                    listening.close()
                tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True), anyio.move_on_after(2):
            await nc.close()
        index.close()
