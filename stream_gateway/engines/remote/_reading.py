"""One server answer read as steps, pushed from the connection's callbacks (:meth:`RemoteEngine.push`),
or queued for a task that pulls them (:meth:`RemoteEngine.generate`, over :class:`StepQueue`).

:class:`Reading` is what both do with the bytes of one read: the frames parsed
(:class:`~._wire.SseFrames`), read as steps (the dialect's :class:`~._dialect.StepReader`), and
the request's books kept (when the server last streamed, tokens so far, the grammar check).
:class:`Pump` hands them on: a :class:`~._stream_http.BodyListener` that hands each read's
steps to a :class:`~stream_gateway.engines.StepSink` inside the connection's ``data_received``, so
that no task is woken per token (``docs/performance.md``, "Writes from the upstream's callbacks").
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from stream_gateway.engines._base import EngineStep, ReadControl, StepSink

if TYPE_CHECKING:
    from stream_gateway.engines._pool import Upstream
    from stream_gateway.engines.remote._dialect import StepReader
    from stream_gateway.engines.remote._grammar import GrammarCheck
    from stream_gateway.engines.remote._stream_http import HttpFailure, StreamResponse
    from stream_gateway.engines.remote._wire import SseFrames

__all__ = ["Pump", "Reading", "StepQueue", "TokenCount"]


class TokenCount:
    """The engine's count of tokens streamed, shared by its requests' readings."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0


class Reading:
    """One answer's reads into steps, and its books (see the module docstring).

    :attr:`finished`: a step with a finish reason was handed out (the steps after it in the same
    read are dropped); :attr:`ended`: the stream ended, by its end, ``[DONE]``, or :meth:`take`
    of ``None`` (the wait for what follows a finishing step is over)."""

    __slots__ = ("ended", "finished", "first_at", "frames", "grammar", "reader", "tokens", "total", "upstream")

    def __init__(
        self, upstream: Upstream, frames: SseFrames, reader: StepReader, grammar: GrammarCheck | None, total: TokenCount
    ) -> None:
        self.upstream = upstream
        self.frames = frames
        self.reader = reader
        self.grammar = grammar
        self.total = total
        self.first_at = 0.0  # when the first step came (0.0: none yet)
        self.tokens = 0
        self.finished = False
        self.ended = False

    def take(self, data: bytes | None) -> list[EngineStep]:
        """The steps of one read's bytes (``None``: the stream ended, or the wait is over)."""
        reader = self.reader
        steps = reader.feed(self.frames.feed(data)) if data is not None else []
        if data is None or self.frames.done:
            self.ended = True
            steps += reader.end()
        if not steps:
            return steps
        self.upstream.streamed_at = now = time.monotonic()
        self.first_at = self.first_at or now
        grammar = self.grammar
        for i, step in enumerate(steps):
            n = len(step.token_ids)
            self.tokens += n
            self.total.n += n
            if grammar is not None:
                grammar.take(step.token_ids, self.upstream.url)
            if step.finish_reason is not None:
                self.finished = True
                del steps[i + 1 :]
                break
        return steps


class Pump:
    """A :class:`Reading` pushed into a sink from the connection's callbacks (a body listener).

    :attr:`done` resolves when the sink is done (:attr:`stopped`), the reading finished or ended, or something
    failed: :attr:`error` is then the connection's failure or the reading's (an
    :class:`~._wire.UpstreamFailed` frame, a grammar violation: the engine's failover decides), or
    what the sink raised (:attr:`sink_failed`: raised as it is, never failed over). A finishing
    step a reader holds back (vLLM's usage frame) is given up on after the reader's ``wait_s``, by
    a timer, as the pulled way's ``move_on_after`` gives up."""

    __slots__ = ("_response", "_timer", "done", "error", "reading", "sink", "sink_failed", "stopped")

    def __init__(self, reading: Reading, sink: StepSink, response: StreamResponse) -> None:
        self.reading = reading
        self.sink = sink
        self._response = response
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.error: BaseException | None = None
        self.stopped = False  # the sink said it is done
        self.sink_failed = False  # error is the sink's
        self._timer: asyncio.TimerHandle | None = None

    def start(self) -> None:
        """Listen to the answer (what arrived already is handed over at once)."""
        self.sink.reading(self._response)
        self._response.listen(self)

    def close(self) -> None:
        """Hand the sink nothing more (the request is over or abandoned): a held step's timer
        must not wake it after its response is gone."""
        self._stop(None)

    # -- BodyListener --------------------------------------------------------------------------

    def body(self, data: bytes) -> None:
        self._deliver(data)

    def end(self) -> None:
        self._deliver(None)

    def failed(self, error: HttpFailure) -> None:
        self._stop(error)

    # -- inside ------------------------------------------------------------------------------

    def _deliver(self, data: bytes | None) -> None:
        if self.done.done():
            return
        reading = self.reading
        try:
            steps = reading.take(data)
        except Exception as exc:  # the server's error frame, a broken frame, the grammar
            self._stop(exc)
            return
        over = reading.finished or reading.ended
        if steps:
            try:
                if self.sink.take(steps):
                    self.stopped = over = True
            except Exception as exc:  # the sink's own failure, or shutdown: not the server's
                self.sink_failed = True
                self._stop(exc)
                return
        if over:
            self._stop(None)
        elif reading.reader.held is not None and reading.reader.wait_s is not None:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = asyncio.get_running_loop().call_later(reading.reader.wait_s, self._give_up)

    def _give_up(self) -> None:
        self._timer = None
        self._deliver(None)

    def _stop(self, error: BaseException | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.done.done():
            return
        self.error = error
        self.done.set_result(None)


class StepQueue:
    """A sink whose steps wait for a task to take them (:meth:`RemoteEngine.generate`). While
    ``_HIGH_WATER`` steps or more wait untaken, the server's connection is not read (TCP holds it
    back). :meth:`close` (the push ended) lets :meth:`get` return what is left, then ``None``."""

    __slots__ = ("_closed", "_paused", "_reads", "_steps", "_waiter")

    _HIGH_WATER = 64

    def __init__(self) -> None:
        self._steps: list[EngineStep] = []
        self._reads: ReadControl | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False
        self._paused = False

    def reading(self, reads: ReadControl) -> None:
        self._reads = reads

    def take(self, steps: list[EngineStep]) -> bool:
        self._steps += steps
        if len(self._steps) >= self._HIGH_WATER and self._reads is not None and not self._paused:
            self._paused = True
            self._reads.pause()
        self._wake()
        return False  # the reading decides when the answer is over

    async def get(self) -> list[EngineStep] | None:
        """Every step that waits (waiting for one); ``None`` once the push ended and all were taken."""
        while not self._steps:
            if self._closed:
                return None
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        steps, self._steps = self._steps, []
        if self._paused and self._reads is not None:
            self._paused = False
            self._reads.resume()
        return steps

    def close(self, _: object = None) -> None:
        """The push ended (a done callback of its task)."""
        self._closed = True
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
