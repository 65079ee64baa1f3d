"""The seam between the remote engine and a server's wire dialect.

The engine (:mod:`._engine`) owns everything a dialect has in common: the pool, health checks,
failover, the adapter fleet, the streaming client and route checks. A dialect owns only what its
server's API spells differently: the generation route and request body, how its frames become
:class:`~stream_gateway.engines.EngineStep`\\ s (its :class:`StepReader`), and its adapter
routes. A new dialect is one new module with one :class:`Dialect` subclass, named in
:data:`._engine.DIALECTS`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from stream_gateway.engines._base import EngineStep, SamplingParams

if TYPE_CHECKING:
    import httpx

    from stream_gateway.engines.remote._routes import RouteCheck, Wanted

__all__ = ["Dialect", "Exchange", "StepReader"]


@dataclass(frozen=True, slots=True)
class Exchange:
    """What a dialect's reader needs to know of one request besides its frames."""

    url: str
    top_n: int  # alternatives asked for per token
    wanted: Wanted | None  # routes asked for, if any
    routes: RouteCheck
    adapter_version: int | None  # a LoRA adapter's request: every step carries the adapter's version
    pool_version: Callable[[], int]  # the version announced for the pool, for servers that report none


class StepReader(ABC):
    """One response's frames read as steps, synchronously: the remote engine calls :meth:`feed`
    with the payloads of each read (:class:`~._wire.SseFrames`), between one read and the next.

    A reader may hold a finishing step back for frames its server writes after it (vLLM's usage
    frame, SGLang's routes): :attr:`held` is then set, and the engine reads on for at most
    :attr:`wait_s` seconds (``None``: until the stream ends), then takes it from :meth:`end`.
    :attr:`done`: the request's last step was handed out, and the rest of the stream is not read.
    Plain attributes, not properties: the engine reads them once a read."""

    __slots__ = ("done", "held")

    wait_s: ClassVar[float | None] = None

    def __init__(self) -> None:
        self.held: EngineStep | None = None
        self.done = False

    @abstractmethod
    def feed(self, events: list[dict[str, Any]]) -> list[EngineStep]:
        """The steps of the payloads that arrived together (none yet, one, or one per weight version)."""

    @abstractmethod
    def end(self) -> list[EngineStep]:
        """The stream ended, or the wait for what follows a finishing step is over: what is held."""


class Dialect(ABC):
    """One server API: the body of a token-in generation request, and its frames read as steps."""

    engine: ClassVar[str]  # the engine's name on the command line (``--engine vllm-http``)
    generate_path: ClassVar[str]
    load_adapter_path: ClassVar[str]
    unload_adapter_path: ClassVar[str]
    routes_start_field: ClassVar[str]  # where a request says from which position it wants routes
    constrained: ClassVar[bool] = False  # the server follows a request's grammar (structured outputs)
    drives_weights: ClassVar[bool] = False  # the gateway can load a checkpoint into its servers (reload_weights)
    interval_at: ClassVar[tuple[str, ...]] = ()  # the body's path to tokens a frame (vLLM's stream_interval)

    @abstractmethod
    def body(
        self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams, *, model: str, adapter: str | None
    ) -> dict[str, Any]:
        """The request body: ``model`` is the served model's name, ``adapter`` a LoRA adapter's
        versioned name (then the request runs on that adapter)."""

    @abstractmethod
    def reader(self, exchange: Exchange) -> StepReader:
        """A reader of one response's frames as steps."""

    def ask_interval(self, body: dict[str, Any], tokens: int) -> None:
        """Ask for ``tokens`` sampled tokens a frame (``body`` is :meth:`body`'s; :mod:`._interval`)
        where :attr:`interval_at` says the request takes it; a server without such a setting per
        request streams as it was started (SGLang: its ``--stream-interval``)."""
        if not self.interval_at:
            return
        *path, field = self.interval_at
        for key in path:
            body = body[key]
        body[field] = tokens

    def want_routes(self, body: dict[str, Any], start: int) -> None:
        """Ask for the routed experts of every position from ``start`` on (``body`` is :meth:`body`'s)."""
        body["return_routed_experts"] = True
        if start:
            body[self.routes_start_field] = start

    async def reload_weights(self, client: httpx.AsyncClient, url: str, path: str, version: int) -> None:
        """Load the checkpoint directory ``path`` into the server at ``url``, labelled ``version``,
        keeping its requests in flight (only where :attr:`drives_weights`)."""
        raise NotImplementedError(f"the {self.engine} engine does not load weights into its servers")

    async def label_weights(self, client: httpx.AsyncClient, url: str, version: int) -> None:
        """Label the weights the server at ``url`` serves ``version`` (only where :attr:`drives_weights`)."""
        raise NotImplementedError(f"the {self.engine} engine does not load weights into its servers")

    async def served_version(self, client: httpx.AsyncClient, url: str) -> str | None:
        """The label of the weights the server at ``url`` serves (only where :attr:`drives_weights`)."""
        raise NotImplementedError(f"the {self.engine} engine does not load weights into its servers")

    async def model_path(self, client: httpx.AsyncClient, url: str) -> str | None:
        """The served model's name when ``/v1/models`` does not answer (``None``: no other way)."""
        return None
