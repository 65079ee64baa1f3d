"""Serving prepared completions: the token loop, and how a response takes its output.

The service decides how a response's output is produced; the HTTP layer only sends what it gets.

- **A stream of one choice** (every agent's request): :meth:`CompletionService.stream` returns a
  ``push`` coroutine that writes each frame the moment its step is read, through the HTTP layer's
  :class:`FrameWriter` (a write goes to the socket at once, from whatever callback it is made in).
  On an engine that pushes (:class:`~stream_gateway.engines.PushEngine`: the remote engines), the
  steps are taken in the upstream connection's callbacks and written from there: no task, no
  generator and no ASGI ``await`` per token; the response's task waits once, for the end. On the
  others, the response's task pulls the engine's steps and writes them. A client that falls behind
  pauses the engine's reads (pushed) or the pulls, until its writes are out.
- **A stream of several choices** (``n > 1``, or several prompts): one engine request per choice
  runs in a producer task group that puts :class:`~._updates.ChoiceUpdate` objects into an
  :class:`~._channel.UpdateChannel`; the writes take everything waiting in it at once and encode
  it with the protocol's :class:`FrameEncoder`. The response runs the producer as its
  ``data_sender_callable``, so a client that disconnects cancels it, which closes the engine
  iterators, which aborts the engine requests. No task group ever straddles a ``yield``.
- **A whole response** (:meth:`CompletionService.collect`) folds the channel into
  :class:`~._updates.ChoiceResult` objects.

Every way keeps the same books (:class:`_Books`): a response in progress, its status once, and an
abort when a choice did not finish. The service knows no wire format: the protocols
(:mod:`stream_gateway.protocols`) prepare requests through it and encode what it produces.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, replace
from functools import cached_property, lru_cache, partial
from typing import Any, Protocol

import anyio
from transformers import PreTrainedTokenizerBase

from stream_gateway._errors import EngineError, GatewayError, ShuttingDown
from stream_gateway._metrics import GatewayMetrics
from stream_gateway._settings import Settings
from stream_gateway.capture import EventRecorder
from stream_gateway.completion._channel import UpdateChannel, coalesce, fold_tool_calls
from stream_gateway.completion._prepare import PreparedCompletion, Preparer
from stream_gateway.completion._text import TextAssembler
from stream_gateway.completion._thinking import ThinkingStream
from stream_gateway.completion._turn import Spend, Turns
from stream_gateway.completion._updates import ChoiceResult, ChoiceUpdate
from stream_gateway.engines import Engine, EngineStep, PushEngine, ReadControl, StepSink
from stream_gateway.reasoning import ThinkingSigner
from stream_gateway.sessions import SessionDirectory
from stream_gateway.tool_parsers import ParsedDelta, ToolCallDelta, ToolCallStreamParser, create_tool_parser

__all__ = ["CompletionService", "FrameEncoder", "FrameWriter", "StreamOutput", "TokenText"]

log = logging.getLogger(__name__)

TokenText = Callable[[int], tuple[str, list[int]]]
"""``token id -> (text, utf-8 bytes)``, as logprobs entries show a token."""


class FrameEncoder(Protocol):
    """Turns a response's updates into SSE frames (chat chunks, text completion chunks, Messages events)."""

    def update(self, update: ChoiceUpdate) -> bytes: ...

    def end(self, prompt_tokens: int, completion_tokens: int, include_usage: bool) -> bytes: ...

    def error(self, error: GatewayError) -> bytes: ...


class FrameWriter(Protocol):
    """Where a stream of one choice writes its frames (the HTTP layer's): a write goes out at once,
    from a task or from an I/O callback, and never waits; while the client is behind (:attr:`behind`),
    writes are held in order and the producer pauses (:meth:`when_behind`)."""

    behind: bool

    def write(self, frame: bytes) -> None: ...

    def when_behind(self, pause: Callable[[], None], resume: Callable[[], None]) -> None:
        """Call ``pause`` when the client falls behind and ``resume`` once it caught up."""

    async def drained(self) -> None:
        """Return once every write is out; raise what a write raised."""


@dataclass(frozen=True, slots=True)
class StreamOutput:
    """What a streamed response sends: either ``push`` (a stream of one choice: it writes its frames
    through a :class:`FrameWriter`), or its ``writes`` and the ``producer`` to run beside them."""

    writes: AsyncIterator[bytes] | None
    producer: Callable[[], Awaitable[None]] | None
    push: Callable[[FrameWriter], Awaitable[None]] | None = None


class _Books:
    """One response's metrics: in progress while open, its status once, aborted if a choice did not
    finish. The one place the three ways of producing a response count what happened."""

    __slots__ = ("_metrics", "_status", "choices", "finished", "streamed")

    def __init__(self, metrics: GatewayMetrics, streamed: bool, choices: int) -> None:
        self._metrics = metrics
        self.streamed = "true" if streamed else "false"
        self.choices = choices
        self.finished = 0
        self._status: str | None = None

    def __enter__(self) -> _Books:
        self._metrics.active_streams.inc()
        return self

    def ended(self, error: GatewayError | None = None) -> None:
        """The response ended: well (``error`` is ``None``) or with ``error`` sent to the client."""
        self._status = "200" if error is None else str(error.status_code)

    def __exit__(self, *_: object) -> None:
        metrics = self._metrics
        metrics.active_streams.dec()
        if self._status is not None:
            metrics.requests.labels(self.streamed, self._status).inc()
        if self.finished < self.choices:
            metrics.aborted.inc()


def _as_gateway_error(exc: BaseException, completion_id: str) -> GatewayError:
    """``exc`` as the client sees it: a bug, not bad input, is logged and becomes a generic
    :class:`EngineError` (an error frame rather than a silent ``[DONE]`` that a client would take
    for a complete answer)."""
    if isinstance(exc, GatewayError):
        return exc
    log.error("completion %s failed", completion_id, exc_info=exc)
    return EngineError("The server had an error while processing your request.")


class CompletionService:
    """Prepares requests (:class:`~._prepare.Preparer`), runs their choices, and hands out their output."""

    def __init__(
        self,
        engine: Engine,
        settings: Settings,
        metrics: GatewayMetrics,
        sessions: SessionDirectory,
        recorder: EventRecorder,
        *,
        spend: Spend | None = None,
        adapter_owner: Callable[[str], str | None] | None = None,
    ) -> None:
        self._engine = engine
        self._pusher = engine if isinstance(engine, PushEngine) else None  # a Protocol check costs ~20 us
        self._metrics = metrics
        self._spend = spend
        self._preparer = Preparer(engine, settings, metrics, sessions, recorder)
        if adapter_owner is not None:
            self._preparer.admission.adapter_owner = adapter_owner  # another tenant's adapter is a 404
        self.prepare = self._preparer.chat
        self.prepare_tokens = self._preparer.tokens
        self.count_tokens = self._preparer.count_tokens
        self.check_model = self._preparer.admission.check_model_and_n
        self._turns = Turns(recorder, sessions, metrics, spend, settings.durable_wait_seconds)
        self._stopping: str | None = None  # why streams in flight must end (stop_streams)
        self.signer = ThinkingSigner.from_file(settings.reasoning_key_file)
        """Signs the thinking the edges hand out (Anthropic ``signature``, Responses ``encrypted_content``)."""

    def stop_streams(self, why: str) -> None:
        """End every choice in flight at its next step with :class:`ShuttingDown`: the client gets an
        error (a stream, an error frame and ``[DONE]``), the turn is recorded as aborted with the
        reason ``shutdown``. Graceful shutdown calls it once the grace period is over."""
        if self._stopping is None:
            log.warning("ending the streams still in flight: %s", why)
            self._stopping = f"The gateway is shutting down: {why}."

    @property
    def thinking_switch(self) -> bool:
        """Whether the served model's chat template reads ``enable_thinking`` (it can think or not)."""
        return "enable_thinking" in self._preparer.template_variables

    @property
    def thinks(self) -> bool:
        """Whether the served model thinks (a reasoning parser is chosen; a bad one fails here)."""
        return self._preparer.reasoning is not None

    @property
    def token_text(self) -> TokenText:
        """``token id -> (text, bytes)``, cached (the engine's tokenizer)."""
        return self._token_text

    @cached_property
    def _token_text(self) -> TokenText:
        # Lazily: the engine's tokenizer exists only once the engine has started.
        return lru_cache(maxsize=None)(_token_text_function(self._engine.tokenizer))

    # -- producing -------------------------------------------------------------------------

    def stream(
        self,
        batch: Sequence[PreparedCompletion],
        encoder: FrameEncoder,
        first: bytes | None,
        include_usage: bool,
    ) -> StreamOutput:
        """How ``batch``'s streamed response is produced: its writes (``first`` if any, the updates,
        usage if asked, with the protocol's end), and the producer to run beside them, if any."""
        choices = sum(p.n for p in batch)
        if choices == 1:
            return StreamOutput(None, None, partial(self._stream_one, batch[0], encoder, first, include_usage))
        channel = UpdateChannel()
        prompt_tokens = sum(len(p.prompt_ids) for p in batch)
        writes = self._frames(encoder, channel, first, choices, prompt_tokens, include_usage)
        return StreamOutput(writes, partial(self._produce, batch, channel))

    async def _produce(self, batch: Sequence[PreparedCompletion], channel: UpdateChannel) -> None:
        """Run every choice (of every prompt); put their updates, or one error, into ``channel`` and close it."""
        try:
            self._count_prompts(batch)
            if len(batch) == 1 and batch[0].n == 1:
                await self._run_choice(batch[0], 0, channel)  # a whole response of one choice: no task group
            else:
                async with anyio.create_task_group() as tg:
                    for item in batch:
                        for index in range(item.n):
                            tg.start_soon(self._run_choice, item, index, channel)
        except* Exception as group:
            channel.put(_as_gateway_error(group.exceptions[0], batch[0].completion_id))
        finally:
            channel.close()

    def _count_prompts(self, batch: Sequence[PreparedCompletion]) -> None:
        for item in batch:
            self._metrics.prompt_tokens.inc(len(item.prompt_ids))
            if self._spend is not None:
                self._spend(item.session.tenant, len(item.prompt_ids) * item.n)

    async def _run_choice(self, prepared: PreparedCompletion, choice: int, channel: UpdateChannel) -> None:
        """One choice's updates into the channel (a producer task of a response with several)."""
        run = _Choice(self, prepared, choice)
        try:
            async with aclosing(run.steps()) as steps:
                async for step in steps:
                    update = run.step(step)
                    if update is not None:
                        channel.put(update)
                        if update.finish_reason is not None:
                            break  # leaving the block closes the iterator: a stop string aborts the request
        except BaseException as exc:
            run.failed(exc)
            raise
        finally:
            await run.finish()

    async def _frames(
        self,
        encoder: FrameEncoder,
        channel: UpdateChannel,
        first: bytes | None,
        choices: int,
        prompt_tokens: int,
        include_usage: bool,
    ) -> AsyncIterator[bytes]:
        """The writes of a streamed response with several choices: each holds everything that
        waited in the channel, one frame per choice (:func:`~._channel.coalesce`)."""
        completion_tokens = 0
        with _Books(self._metrics, True, choices) as books:
            if first is not None:
                yield first
            while (items := await channel.take()) is not None:
                frames = []
                for item in coalesce(items):
                    if isinstance(item, GatewayError):
                        books.ended(item)
                        frames.append(encoder.error(item))
                        yield b"".join(frames)
                        return
                    completion_tokens += len(item.token_ids)
                    books.finished += item.finish_reason is not None
                    frames.append(encoder.update(item))
                yield frames[0] if len(frames) == 1 else b"".join(frames)
            yield encoder.end(prompt_tokens, completion_tokens, include_usage)
            books.ended()

    async def _stream_one(
        self,
        prepared: PreparedCompletion,
        encoder: FrameEncoder,
        first: bytes | None,
        include_usage: bool,
        out: FrameWriter,
    ) -> None:
        """A streamed response with one choice of one prompt, written to ``out`` as its steps are read.

        The steps are pushed (:class:`_FrameSink`, in the engine's I/O callbacks) where the engine
        can, pulled in this task otherwise. Tokens still coalesce when the client falls behind:
        while its writes wait, the engine's reads pause (pushed; the server's frames wait in TCP and
        the next read takes them together) or its steps queue (pulled)."""
        with _Books(self._metrics, True, 1) as books:
            self._count_prompts([prepared])
            if first is not None:
                out.write(first)
            run: _Choice | None = None
            sink: _FrameSink | None = None
            try:
                run = _Choice(self, prepared, 0)
                sink = _FrameSink(run, encoder, out, books)
                if self._pusher is not None and not prepared.images:
                    await run.push(self._pusher, sink)
                else:
                    await _pull(run, sink, out)
                await run.finish()  # here, so that a failure to record it is an error frame too
            except Exception as exc:
                if run is not None:
                    run.failed(exc)
                    await run.finish()  # recorded before the client reads the error
                error = _as_gateway_error(exc, prepared.completion_id)
                books.ended(error)
                out.write(encoder.error(error))
                return
            except BaseException as exc:  # cancelled: the client left
                if run is not None:
                    run.failed(exc)
                raise
            finally:
                if run is not None:
                    await run.finish()
            out.write(encoder.end(len(prepared.prompt_ids), sink.tokens, include_usage))
            books.ended()

    async def collect(
        self, batch: Sequence[PreparedCompletion], wait_disconnect: Callable[[], Awaitable[None]]
    ) -> list[ChoiceResult] | None:
        """Run the choices of ``batch`` to the end; ``None`` if the client went away first."""
        results = [ChoiceResult(i) for i in range(sum(p.n for p in batch))]
        error: GatewayError | None = None
        channel = UpdateChannel()
        with _Books(self._metrics, False, len(results)) as books:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_cancel_when, wait_disconnect, tg.cancel_scope)
                tg.start_soon(self._produce, batch, channel)
                while (items := await channel.take()) is not None:
                    for item in items:
                        if isinstance(item, GatewayError):
                            error = item
                        else:
                            results[item.index].add(item)
                tg.cancel_scope.cancel()  # the producer is done; stop watching the client
            books.finished = sum(r.finish_reason is not None for r in results)
            if error is not None:
                books.ended(error)
                raise error
            if books.finished < books.choices:
                return None
            books.ended()
        return results


class _Choice:
    """One choice of a response: its per-token state, and :meth:`step`, the per-token path.

    Per engine step: list appends, the detokenizer, the reasoning and tool-call parsers, and (when
    there is something to send) one :class:`ChoiceUpdate`. Metrics and events are per turn
    (:class:`~._turn.TurnLifecycle`), or every few dozen tokens for live deltas. Synchronous, so the
    caller's loop over the engine's steps is the one generator between the engine and the socket
    (``docs/performance.md``, "The floor"); its callers: a stream of one choice
    (:meth:`CompletionService._stream_one`) and each choice of several (``_run_choice``).
    """

    __slots__ = (
        "_assembler",
        "_engine",
        "_parser",
        "_recorded",
        "_sent",
        "_service",
        "_spans",
        "_thinking",
        "_top",
        "_turn",
        "abort_detail",
        "abort_reason",
        "index",
        "params",
        "prepared",
        "request_id",
        "result",
    )

    def __init__(self, service: CompletionService, prepared: PreparedCompletion, choice: int) -> None:
        params = prepared.params
        if choice and params.seed is not None:
            params = replace(params, seed=params.seed + choice)  # n seeded choices must differ
        self.params = params
        self.prepared = prepared
        self.index = index = prepared.first_index + choice
        self._service = service
        self._engine = engine = service._engine
        backend = engine.tokenizer.backend_tokenizer
        self._assembler = TextAssembler(backend, prepared.stops)
        self._thinking = ThinkingStream.of(prepared.reasoning, prepared.prompt_ids, backend, prepared.split_reasoning)
        self._parser = _tool_parser(prepared)
        self.result = result = ChoiceResult(index)
        self._top = result.top_logprobs if params.top_logprobs else None  # the whole turn's, as ids and logprobs
        self._sent = 0  # tokens already put into an update
        self.request_id = f"{prepared.completion_id}-{index}"
        version = engine.adapters.get(params.adapter, 0) if params.adapter is not None else engine.policy_version
        self._turn = service._turns.begin(prepared, index, params, version)
        # [version, first output index] spans: a weight update between two steps starts a new one.
        self._spans: list[tuple[int, int]] = []
        self.abort_reason: str | None = None
        self.abort_detail: str | None = None
        self._recorded = False

    def steps(self) -> AsyncGenerator[EngineStep, None]:
        """The engine's steps for this choice (close the iterator to abort the request)."""
        prepared = self.prepared
        images = {"images": [i.image for i in prepared.images]} if prepared.images else {}
        return self._engine.generate(
            self.request_id, prepared.prompt_ids, self.params, affinity=prepared.session.session_id, **images
        )

    async def push(self, engine: PushEngine, sink: StepSink) -> None:
        """This choice's steps pushed into ``sink`` (:meth:`~stream_gateway.engines.PushEngine.push`)."""
        prepared = self.prepared
        await engine.push(self.request_id, prepared.prompt_ids, self.params, sink, affinity=prepared.session.session_id)

    def step(self, step: EngineStep) -> ChoiceUpdate | None:
        """One engine step into the turn; the update to send, or ``None`` when nothing is to be sent
        yet (its tokens then ride along with the next update, so no frame is empty). An update with
        a finish reason is the last: the caller closes the engine's iterator after it."""
        stopping = self._service._stopping
        if stopping is not None:
            raise ShuttingDown(stopping)
        result = self.result
        ids, logprobs, top, spans = result.token_ids, result.logprobs, self._top, self._spans
        if not spans or spans[-1][0] != step.policy_version:
            spans.append((step.policy_version, len(ids)))
        if step.version_spans is not None:
            self._spans = spans = list(step.version_spans)  # the server's own account, given at the end
        ids.extend(step.token_ids)
        logprobs.extend(step.logprobs)
        result.take_extras(step)
        if top is not None and step.top_logprobs is not None:
            top.extend(step.top_logprobs)
        self._turn.step(ids, logprobs, time.perf_counter())
        step_ids: Sequence[int] = step.token_ids
        thought = ""
        thinking = self._thinking
        if thinking is not None and thinking.active:
            thought, step_ids = thinking.feed(step_ids)
        assembler = self._assembler
        delta = assembler.feed(step_ids)
        finish: str | None = "stop" if delta.stopped else step.finish_reason
        text = delta.text if finish is None or delta.stopped else delta.text + assembler.flush()
        if thinking is not None:
            text = thinking.answer(text)
        calls: tuple[ToolCallDelta, ...] = ()
        parser = self._parser
        if parser is not None:
            parsed = parser.feed(text)
            if finish is not None:
                tail = parser.finish()
                parsed = ParsedDelta(parsed.content + tail.content, parsed.tool_calls + tail.tool_calls)
            text, calls = parsed.content, parsed.tool_calls
            if finish == "stop" and parser.calls:
                finish = "tool_calls"
        if not (text or thought or calls or finish is not None):
            return None
        sent, end = self._sent, len(ids)
        final_spans = list(spans) if finish is not None else None
        update = ChoiceUpdate(
            self.index,
            text,
            ids[sent:end],
            logprobs[sent:end],
            top[sent:end] if top is not None else None,
            finish,
            calls,
            final_spans,
            assembler.matched if delta.stopped else None,
            thought,
        )
        self._sent = end
        result.text_parts.append(text)
        result.reasoning_parts.append(thought)
        if calls:
            result.call_deltas.extend(calls)
        if finish is not None:
            result.finish_reason, result.version_spans = finish, final_spans
            update.reasoning_tokens, update.answer_start = ThinkingStream.span_of(thinking)
            prepared = self.prepared
            update.routes = result.routes_from(prepared.routes_from) if prepared.return_routes else None
        return update

    def failed(self, exc: BaseException) -> None:
        """The choice ended with ``exc``: cancelled or closed (the client left, or a sibling choice
        failed), or an error (the shutdown's, or the engine's)."""
        if isinstance(exc, anyio.get_cancelled_exc_class() | GeneratorExit):
            self.abort_reason = "client_disconnected"
        elif isinstance(exc, Exception):
            self.abort_reason = "shutdown" if isinstance(exc, ShuttingDown) else "engine_error"
            self.abort_detail = str(exc)

    async def finish(self) -> None:
        """Record the turn however it ended (once; the later calls return at once)."""
        if self._recorded:
            return
        self._recorded = True
        result = self.result
        result.reasoning_tokens, result.answer_start = ThinkingStream.span_of(self._thinking)
        await self._turn.finish(result, self._spans, self.abort_reason, self.abort_detail)


class _FrameSink:
    """A stream of one choice's steps, made frames and written (the engine's
    :class:`~stream_gateway.engines.StepSink`): per step, :meth:`_Choice.step`, the protocol's
    encoder and one write. Runs in the engine's I/O callbacks when pushed."""

    __slots__ = ("_books", "_encoder", "_out", "_run", "tokens")

    def __init__(self, run: _Choice, encoder: FrameEncoder, out: FrameWriter, books: _Books) -> None:
        self._run = run
        self._encoder = encoder
        self._out = out
        self._books = books
        self.tokens = 0  # completion tokens written

    def reading(self, reads: ReadControl) -> None:
        self._out.when_behind(reads.pause, reads.resume)

    def take(self, steps: list[EngineStep]) -> bool:
        run, out, encoder = self._run, self._out, self._encoder
        for step in steps:
            update = run.step(step)
            if update is None:
                continue
            self.tokens += len(update.token_ids)
            if len(update.tool_calls) > 1:  # one entry per call, as coalesce() makes them
                update.tool_calls = fold_tool_calls(update.tool_calls)
            out.write(encoder.update(update))
            if update.finish_reason is not None:
                self._books.finished = 1
                return True  # a stop string aborts the request
        return False


async def _pull(run: _Choice, sink: _FrameSink, out: FrameWriter) -> None:
    """An engine that does not push: its steps pulled in this task, into ``sink``."""
    async with aclosing(run.steps()) as steps:
        async for step in steps:
            if sink.take([step]):
                break  # leaving the block closes the iterator: a stop string aborts the request
            if out.behind:
                await out.drained()


def _tool_parser(prepared: PreparedCompletion) -> ToolCallStreamParser | None:
    """A fresh tool-call parser for one choice, or ``None`` when the output is plain content."""
    return create_tool_parser(prepared.tool_parser, prepared.tool_names) if prepared.tool_parser else None


async def _cancel_when(event: Callable[[], Awaitable[None]], scope: anyio.CancelScope) -> None:
    await event()
    scope.cancel()


def _token_text_function(tokenizer: PreTrainedTokenizerBase) -> Any:
    """``token id -> (text, utf-8 bytes)`` for logprobs entries.

    Byte-level BPE tokens map back to their exact bytes (a token may hold half a character); other
    tokenizers fall back to the decoded text's bytes.
    """
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_of = {char: byte for byte, char in bytes_to_unicode().items()}  # type: ignore[no-untyped-call]

    def token_text(token_id: int) -> tuple[str, list[int]]:
        piece = tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and piece and all(c in byte_of for c in piece):
            raw = bytes(byte_of[c] for c in piece)
            return raw.decode("utf-8", errors="replace"), list(raw)
        text = str(tokenizer.decode([token_id]))
        return text, list(text.encode("utf-8"))

    return token_text
