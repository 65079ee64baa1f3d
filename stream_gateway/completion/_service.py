"""Serving one chat completion: validate, render the prompt, run the choices, encode the output.

The producer (:meth:`CompletionService.produce`) runs one engine request per choice inside its
own task group and puts :class:`ChoiceUpdate` objects into an :class:`~._streaming.UpdateChannel`;
the response body takes everything waiting in it at once (:mod:`._streaming`). The response runs
the producer as its ``data_sender_callable`` so a client that disconnects cancels it, which closes
the engine iterators, which aborts the engine requests. No task group ever straddles a ``yield``.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, replace
from functools import cached_property, lru_cache
from typing import Any, Protocol

import anyio
from transformers import PreTrainedTokenizerBase

from stream_gateway.completion._request import ChatCompletionRequest
from stream_gateway.capture._recorder import EventRecorder
from stream_gateway.protocols._chat import ChoiceResult, ChoiceUpdate, ChunkEncoder, completion_body
from stream_gateway.completion._context import Context, ContextBuilder, cheap_to_build
from stream_gateway._errors import (
    Conflict,
    ContextLengthExceeded,
    EngineError,
    GatewayError,
    InvalidRequest,
    ModelNotFound,
    UnsupportedParameter,
)
from stream_gateway.completion._fingerprint import assistant_fingerprint, extend_key, message_fingerprint, prefix_keys, tools_fingerprint
from stream_gateway._metrics import GatewayMetrics
from stream_gateway.sessions._store import Session, Turn
from stream_gateway._settings import Settings
from stream_gateway.sessions._shared import SessionDirectory
from stream_gateway.completion._channel import UpdateChannel, coalesce
from stream_gateway.completion._text import TextAssembler
from stream_gateway.constraints import Constraint, response_format_constraint, tool_choice_constraint
from stream_gateway.constraints import check as check_grammar
from stream_gateway.engines import Engine, SamplingParams
from stream_gateway.tool_parsers import ParsedDelta, ToolCallDelta, create_tool_parser


class FrameEncoder(Protocol):
    """Turns a response's updates into SSE frames (chat chunks, text completion chunks, Messages events)."""

    def update(self, update: ChoiceUpdate) -> bytes: ...

    def end(self, prompt_tokens: int, completion_tokens: int, include_usage: bool) -> bytes: ...

    def error(self, error: GatewayError) -> bytes: ...


log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PreparedCompletion:
    """A validated request, its prompt ids and everything needed to serve it."""

    completion_id: str
    created: int
    arrived: float
    model: str
    session: Session
    context: Context
    conversation_key: bytes  # prefix key of the request's messages (turn keys extend it)
    context_length: int
    prompt_ids: list[int]
    params: SamplingParams
    n: int
    stops: tuple[str, ...]
    logprobs: bool
    return_token_ids: bool
    include_usage: bool
    tool_parser: str | None  # None: the output is plain content
    tool_names: frozenset[str]
    legacy_functions: bool = False  # the request used ``functions``: answer with ``function_call``
    first_index: int = 0  # choice indices start here (a batch of prompts numbers its choices on)
    token_in: bool = False  # prompt ids given by the client (``/v1/completions``): continued by id prefix only


class CompletionService:
    """Turns validated requests into engine requests and engine steps into responses."""

    def __init__(
        self,
        engine: Engine,
        settings: Settings,
        metrics: GatewayMetrics,
        sessions: SessionDirectory,
        recorder: EventRecorder,
    ) -> None:
        self._engine = engine
        self._settings = settings
        self._metrics = metrics
        self._sessions = sessions
        self._recorder = recorder
        self.spend: Callable[[str, int], None] | None = None  # (tenant, tokens): per-tenant token limits

    @cached_property
    def _context_builder(self) -> ContextBuilder:
        # Lazily: the engine's tokenizer exists only once the engine has started.
        return ContextBuilder(self._engine.tokenizer)

    @property
    def token_text(self) -> Any:
        """``token id -> (text, bytes)``, cached (the engine's tokenizer)."""
        return self._token_text

    @cached_property
    def _token_text(self) -> Any:
        # Lazily: the engine's tokenizer exists only once the engine has started.
        return lru_cache(maxsize=None)(_token_text_function(self._engine.tokenizer))

    # -- request preparation ---------------------------------------------------------------

    async def prepare(
        self, body: ChatCompletionRequest, *, tenant: str, session_id: str | None = None, agent: str | None = None
    ) -> PreparedCompletion:
        """Validate ``body``, place it in a session, and build its token-exact prompt.

        With ``session_id`` the request belongs to that session (created on first use);
        without, it joins the tenant's session whose conversation it continues, or a new one.
        ``agent`` (the User-Agent) goes into the ``session.opened`` event.
        """
        arrived = time.perf_counter()
        engine = self._engine
        check_model_and_n(engine, self._settings, body.model, body.n)
        body.check_supported()
        await self._check_size(body)
        constraint = None
        if body.response_format is not None or isinstance(body.tool_choice, dict) or body.tool_choice == "required":
            constraint = await anyio.to_thread.run_sync(self._constraint, body)
        keys = prefix_keys(tools_fingerprint(body.tools), [message_fingerprint(m) for m in body.messages])
        # Turn keys end with an assistant message; the request's last message is always new.
        positions = [i for i, m in enumerate(body.messages[:-1]) if m.role == "assistant"]
        session: Session | None
        parent: Turn | None = None
        unavailable: str | None = None  # why the shared state could not say whether a deeper turn exists
        if session_id is not None:
            session = await self._sessions.lookup(session_id, tenant)
            if session is not None and session.closed:
                raise Conflict(f"Session `{session_id}` is closed.", param="session_id", code="session_closed")
            if session is not None:
                parent, unavailable = await self._sessions.match(session, keys, positions)
        else:
            found, unavailable = await self._sessions.find(tenant, keys, positions)
            session, parent = found if found is not None else (None, None)
        if cheap_to_build(body.messages, body.tools, parent):
            context = self._context_builder.build(body.messages, body.tools, parent)
        else:
            context = await anyio.to_thread.run_sync(self._context_builder.build, body.messages, body.tools, parent)
        if unavailable is not None and context.fallback_reason is None:
            context = replace(context, fallback_reason=unavailable)
        if context.fallback_reason is not None:
            self._metrics.context_fallbacks.inc()
            log.info("session %s: new root instead of continuing a turn: %s", session_id, context.fallback_reason)
        prompt_ids = context.prompt_ids
        limit = engine.max_model_len
        room = limit - len(prompt_ids)
        requested = body.requested_max_tokens()
        if room <= 0 or (requested is not None and requested > room):
            completion = requested if requested is not None else 1
            raise ContextLengthExceeded(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(prompt_ids) + completion} tokens ({len(prompt_ids)} in the messages, "
                f"{completion} in the completion). Please reduce the length of the messages or completion.",
                param=("max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens")
                if room > 0
                else "messages",
            )
        # Only a request that will run gets a session: failed ones leave nothing behind.
        if session is None:
            session = await self._sessions.open(session_id, tenant)
        if session.closed:  # closed while this request's prompt was being built
            raise Conflict(f"Session `{session.session_id}` is closed.", param="session_id", code="session_closed")
        await self._sessions.prepare_to_write(session)
        if not session.announced:
            self._recorder.session_opened(session, engine.policy_version, agent, body.metadata or {})
        self._sessions.store.touch(session)
        params = SamplingParams(
            max_tokens=requested if requested is not None else min(self._settings.default_max_tokens, room),
            temperature=self._settings.default_temperature if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=max(body.top_k or 0, 0),
            seed=body.seed,
            top_logprobs=(body.top_logprobs or 0) if body.logprobs else 0,
            ignore_eos=body.ignore_eos,
            constraint=constraint,
        )
        return PreparedCompletion(
            completion_id=f"chatcmpl-{secrets.token_hex(12)}",
            created=int(time.time()),
            arrived=arrived,
            model=engine.model_id,
            session=session,
            context=context,
            conversation_key=keys[-1],
            context_length=len(body.messages),
            prompt_ids=prompt_ids,
            params=params,
            n=body.n,
            stops=body.stop_sequences(),
            logprobs=body.logprobs,
            return_token_ids=body.return_token_ids,
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
            tool_parser=self._settings.tool_parser if body.tools and body.tool_choice != "none" else None,
            tool_names=frozenset(t.function.name for t in body.tools or ()),
            legacy_functions=body.legacy_functions,
        )

    @cached_property
    def _longest_token(self) -> int:
        # The most characters one token decodes to: its vocabulary string has one character per
        # byte (byte-level BPE) or per character (SentencePiece), and never fewer.
        return max(len(token) for token in self._engine.tokenizer.get_vocab())

    async def count_tokens(self, body: ChatCompletionRequest) -> int:
        """The prompt tokens ``body`` would take: a full render of its messages and tools."""
        check_model_and_n(self._engine, self._settings, body.model, body.n)
        await self._check_size(body)
        builder = self._context_builder
        return len(await anyio.to_thread.run_sync(builder.render_ids, body.messages, body.tools))

    async def _check_size(self, body: ChatCompletionRequest) -> None:
        """Refuse at once what cannot fit, before fingerprinting, rendering or tokenizing all of it."""
        limit = self._settings.max_messages
        if len(body.messages) > limit:
            raise InvalidRequest(f"A request may hold at most {limit} messages (--max-messages).", param="messages")
        context = self._engine.max_model_len
        chars = sum(len(m.text()) for m in body.messages)
        if chars > context * self._longest_token:
            raise _too_long(context, f"{chars} characters, more than {context} tokens can hold")
        if chars > context * _PLAUSIBLE_CHARS_PER_TOKEN:
            # Suspiciously long: count the tokens of a prefix whose size the context bounds (not
            # the request), off the loop. More tokens than the context there: more in the whole.
            tokens = await anyio.to_thread.run_sync(self._prefix_tokens, body, context * _PREFIX_CHARS_PER_TOKEN)
            if tokens > context:
                raise _too_long(context, f"more than {context} tokens (over {tokens} in their first part)")

    def _prefix_tokens(self, body: ChatCompletionRequest, budget: int) -> int:
        """Tokens in the first ``budget`` characters of the messages' texts, less a margin per cut."""
        encode = self._engine.tokenizer.backend_tokenizer.encode
        tokens = 0
        for message in body.messages:
            text = message.text()[:budget]
            budget -= len(text)
            # A cut inside a word can split it into more tokens than the whole word takes.
            tokens += len(encode(text, add_special_tokens=False).ids) - (_CUT_MARGIN if budget <= 0 else 0)
            if budget <= 0:
                break
        return tokens

    def _constraint(self, body: ChatCompletionRequest) -> Constraint | None:
        """What ``response_format`` or ``tool_choice`` holds the output to (in a worker thread:
        the first grammar for a large vocabulary takes a while); 400 if it cannot be enforced."""
        by_format = response_format_constraint(body.response_format)
        tokenizer = self._engine.tokenizer
        by_choice = tool_choice_constraint(body.tool_choice, body.tools, tokenizer, self._settings.tool_parser)
        if by_format is not None and by_choice is not None:
            raise InvalidRequest("response_format and a forced tool_choice cannot be combined", param="response_format")
        constraint = by_format or by_choice
        if constraint is None:
            return None
        param = "response_format" if by_format is not None else "tool_choice"
        if not self._engine.constrained_decoding:
            raise UnsupportedParameter(
                f"{param} {constraint.kind.replace('_', ' ')} needs constrained decoding, which the "
                f"{self._engine.name} engine does not do; the transformers engine does",
                param=param,
            )
        check_grammar(constraint, tokenizer, param)
        return constraint

    # -- producing -------------------------------------------------------------------------

    async def produce(
        self, prepared: PreparedCompletion | Sequence[PreparedCompletion], channel: UpdateChannel
    ) -> None:
        """Run every choice (of every prompt); put their updates, or one error, into ``channel`` and close it."""
        batch = [prepared] if isinstance(prepared, PreparedCompletion) else prepared
        first = batch[0]
        try:
            for item in batch:
                self._metrics.prompt_tokens.inc(len(item.prompt_ids))
                if self.spend is not None:
                    self.spend(item.session.tenant, len(item.prompt_ids) * item.n)
            if len(batch) == 1 and first.n == 1:
                await self._run_choice(first, 0, channel)  # the common case: no task group to set up
            else:
                async with anyio.create_task_group() as tg:
                    for item in batch:
                        for index in range(item.n):
                            tg.start_soon(self._run_choice, item, index, channel)
        except* GatewayError as group:
            channel.put(group.exceptions[0])  # type: ignore[arg-type]
        except* Exception as group:
            # A bug, not bad input: log it, and end the stream with an error frame rather than a
            # silent [DONE] that a client would take for a complete answer.
            log.error("completion %s failed", first.completion_id, exc_info=group.exceptions[0])
            channel.put(EngineError("The server had an error while processing your request."))
        finally:
            channel.close()

    async def _run_choice(self, prepared: PreparedCompletion, choice: int, channel: UpdateChannel) -> None:
        # The per-token path: per engine step, list appends, the detokenizer, and (when there is
        # text to send) one update put into the channel. Metrics and events are per turn, or
        # every few dozen tokens for live deltas.
        params = prepared.params
        if choice and params.seed is not None:
            params = replace(params, seed=params.seed + choice)  # n seeded choices must differ
        index = prepared.first_index + choice
        assembler = TextAssembler(self._engine.tokenizer.backend_tokenizer, prepared.stops)
        parser = create_tool_parser(prepared.tool_parser, prepared.tool_names) if prepared.tool_parser else None
        result = ChoiceResult(index)
        ids, logprobs = result.token_ids, result.logprobs  # the whole turn's
        top = result.top_logprobs if params.top_logprobs else None
        sent = 0  # tokens already put into an update
        gaps: list[float] = []  # between engine steps, counted into the histogram at the end
        last = prepared.arrived
        first_token_s: float | None = None
        policy_version = self._engine.policy_version
        request_id = f"{prepared.completion_id}-{index}"
        turn_id = f"turn{secrets.token_hex(12)}"
        context = prepared.context
        recorder = self._recorder
        recorder.turn_started(
            prepared.session,
            turn_id,
            context.parent.turn_id if context.parent is not None else None,
            prepared.completion_id,
            index,
            len(prepared.prompt_ids),
            context.reused_prompt_tokens,
            params,
            policy_version,
        )
        deltas = recorder.deltas(prepared.session, turn_id, policy_version)
        # [version, first output index] spans: a weight update between two steps starts a new one.
        spans: list[tuple[int, int]] = []
        abort_reason: str | None = None
        abort_detail: str | None = None
        perf_counter = time.perf_counter
        try:
            async with aclosing(
                self._engine.generate(request_id, prepared.prompt_ids, params, affinity=prepared.session.session_id)
            ) as steps:
                async for step in steps:
                    now = perf_counter()
                    if first_token_s is None:
                        first_token_s = now - prepared.arrived
                        self._metrics.time_to_first_token.observe(first_token_s)
                    else:
                        gaps.append(now - last)
                    last = now
                    if not spans or spans[-1][0] != step.policy_version:
                        spans.append((step.policy_version, len(ids)))
                    if step.version_spans is not None:
                        spans = list(step.version_spans)  # the server's own account, given at the end
                    ids.extend(step.token_ids)
                    logprobs.extend(step.logprobs)
                    if top is not None and step.top_logprobs is not None:
                        top.extend(step.top_logprobs)
                    if deltas is not None:
                        deltas.advance(ids, logprobs, now)
                    delta = assembler.feed(step.token_ids)
                    finish: str | None = "stop" if delta.stopped else step.finish_reason
                    text = delta.text if finish is None or delta.stopped else delta.text + assembler.flush()
                    calls: tuple[ToolCallDelta, ...] = ()
                    if parser is not None:
                        parsed = parser.feed(text)
                        if finish is not None:
                            tail = parser.finish()
                            parsed = ParsedDelta(parsed.content + tail.content, parsed.tool_calls + tail.tool_calls)
                        text, calls = parsed.content, parsed.tool_calls
                        if finish == "stop" and parser.calls:
                            finish = "tool_calls"
                    # Tokens that produced nothing to send yet (half a character, a possible stop
                    # string, an unfinished tool call) ride along with the next update that has
                    # something, so no frame is empty.
                    if text or calls or finish is not None:
                        end = len(ids)
                        final_spans = list(spans) if finish is not None else None
                        update = ChoiceUpdate(
                            index,
                            text,
                            ids[sent:end],
                            logprobs[sent:end],
                            top[sent:end] if top is not None else None,
                            finish,
                            calls,
                            final_spans,
                            assembler.matched if delta.stopped else None,
                        )
                        sent = end
                        result.text_parts.append(text)
                        if calls:
                            result.call_deltas.extend(calls)
                        if finish is not None:
                            result.finish_reason, result.version_spans = finish, final_spans
                        channel.put(update)
                    if finish is not None:
                        return  # leaving the block closes the iterator: a stop string aborts the request
        except anyio.get_cancelled_exc_class():
            abort_reason = "client_disconnected"  # or a sibling choice failed; either way nobody reads on
            raise
        except Exception as exc:
            abort_reason, abort_detail = "engine_error", str(exc)
            raise
        finally:
            # Runs on normal ends, errors and cancellation alike; recording is synchronous.
            self._metrics.completion_tokens.inc(len(ids))
            if self.spend is not None:
                self.spend(prepared.session.tenant, len(ids))
            self._metrics.inter_token_latency.observe_many(gaps)
            if deltas is not None:
                deltas.flush(ids, logprobs)
            turn = self._record_turn(prepared, turn_id, result, spans or [(policy_version, 0)], first_token_s)
            durable = recorder.turn_finished(
                prepared.session,
                turn,
                prepared.completion_id,
                index,
                params,
                abort_reason,
                abort_detail,
            )
            shared = self._sessions.turn_recorded(prepared.session, turn)
            if abort_reason is None:
                # The response ends (usage, [DONE]) once the turn is durable, so a crash cannot
                # take back from the training data what the client already has, and once other
                # replicas can find it.
                if durable is not None:
                    with anyio.move_on_after(self._settings.durable_wait_seconds):
                        await durable.wait()
                await self._sessions.wait_shared(shared)

    def _record_turn(
        self,
        prepared: PreparedCompletion,
        turn_id: str,
        result: ChoiceResult,
        policy_versions: list[tuple[int, int]],
        first_token_s: float | None,
    ) -> Turn:
        content = "".join(result.text_parts)
        calls = tuple(result.tool_calls())
        finished = result.finish_reason is not None
        key = None
        if finished and not prepared.token_in:
            fingerprint = assistant_fingerprint(content, [(c.name, c.arguments) for c in calls])
            key = extend_key(prepared.conversation_key, fingerprint)
        context = prepared.context
        duration = time.perf_counter() - prepared.arrived
        turn = Turn(
            turn_id=turn_id,
            session_id=prepared.session.session_id,
            parent_id=context.parent.turn_id if context.parent is not None else None,
            key=key,
            context_length=prepared.context_length,
            prompt_ids=tuple(prepared.prompt_ids),
            reused_prompt_tokens=context.reused_prompt_tokens,
            output_ids=tuple(result.token_ids),
            logprobs=tuple(result.logprobs),
            finish_reason=result.finish_reason,
            content=content,
            tool_calls=calls,
            policy_version=policy_versions[0][0],
            policy_versions=tuple(policy_versions),
            created_at=time.time() - duration,
            time_to_first_token_s=first_token_s,
            duration_s=duration,
            matches_full_render=context.matches_full_render,
            fallback_reason=context.fallback_reason,
        )
        self._sessions.store.add_turn(prepared.session, turn)
        return turn

    # -- responses -------------------------------------------------------------------------

    def encoder(self, prepared: PreparedCompletion) -> ChunkEncoder:
        """The frame encoder for one streamed response."""
        return ChunkEncoder(
            prepared.completion_id,
            prepared.created,
            prepared.model,
            token_text=self._token_text,
            logprobs=prepared.logprobs,
            token_ids=prepared.return_token_ids,
            legacy_functions=prepared.legacy_functions,
        )

    def stream_frames(self, prepared: PreparedCompletion, channel: UpdateChannel) -> AsyncIterator[bytes]:
        """SSE frames: role, deltas, usage (if asked), ``[DONE]``; or an error frame."""
        encoder = self.encoder(prepared)
        first = encoder.role(prepared.n, prepared.prompt_ids if prepared.return_token_ids else None)
        return self.frames(encoder, channel, first, prepared.n, len(prepared.prompt_ids), prepared.include_usage)

    async def frames(
        self,
        encoder: FrameEncoder,
        channel: UpdateChannel,
        first: bytes | None,
        choices: int,
        prompt_tokens: int,
        include_usage: bool,
    ) -> AsyncIterator[bytes]:
        """The writes of a streamed response: ``first`` (if any), updates, usage (if asked) with ``[DONE]``.

        Each write holds everything that waited in the channel: one frame per choice (see
        :mod:`._streaming`).
        """
        completion_tokens = 0
        finished = 0
        self._metrics.active_streams.inc()
        try:
            if first is not None:
                yield first
            while (items := await channel.take()) is not None:
                frames = []
                for item in coalesce(items):
                    if isinstance(item, GatewayError):
                        self._metrics.requests.labels("true", str(item.status_code)).inc()
                        frames.append(encoder.error(item))
                        yield b"".join(frames)
                        return
                    completion_tokens += len(item.token_ids)
                    finished += item.finish_reason is not None
                    frames.append(encoder.update(item))
                yield frames[0] if len(frames) == 1 else b"".join(frames)
            yield encoder.end(prompt_tokens, completion_tokens, include_usage)
            self._metrics.requests.labels("true", "200").inc()
        finally:
            self._metrics.active_streams.dec()
            if finished < choices:
                self._metrics.aborted.inc()

    async def complete(
        self, prepared: PreparedCompletion, wait_disconnect: Callable[[], Awaitable[None]]
    ) -> dict[str, Any] | None:
        """Run a non-streamed completion to the end and build its body.

        Returns ``None`` when ``wait_disconnect`` returns first: the client is gone, and leaving
        the task group has aborted the engine requests.
        """
        results = await self.collect([prepared], wait_disconnect)
        if results is None:
            return None
        return completion_body(
            prepared.completion_id,
            prepared.created,
            prepared.model,
            prepared.prompt_ids,
            results,
            token_text=self._token_text,
            logprobs=prepared.logprobs,
            token_ids=prepared.return_token_ids,
            legacy_functions=prepared.legacy_functions,
        )

    async def collect(
        self, batch: Sequence[PreparedCompletion], wait_disconnect: Callable[[], Awaitable[None]]
    ) -> list[ChoiceResult] | None:
        """Run the choices of ``batch`` to the end; ``None`` if the client went away first."""
        results = [ChoiceResult(i) for i in range(sum(p.n for p in batch))]
        error: GatewayError | None = None
        channel = UpdateChannel()
        self._metrics.active_streams.inc()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_cancel_when, wait_disconnect, tg.cancel_scope)
                tg.start_soon(self.produce, batch, channel)
                while (items := await channel.take()) is not None:
                    for item in items:
                        if isinstance(item, GatewayError):
                            error = item
                        else:
                            results[item.index].add(item)
                tg.cancel_scope.cancel()  # the producer is done; stop watching the client
        finally:
            self._metrics.active_streams.dec()
        if error is not None:
            self._metrics.requests.labels("false", str(error.status_code)).inc()
            raise error
        if any(r.finish_reason is None for r in results):
            self._metrics.aborted.inc()
            return None
        self._metrics.requests.labels("false", "200").inc()
        return results


_PLAUSIBLE_CHARS_PER_TOKEN = 4  # above this many characters per context token, count before rendering
_PREFIX_CHARS_PER_TOKEN = 16  # ...the tokens of at most this many characters per context token
_CUT_MARGIN = 16


def _too_long(context: int, holds: str) -> ContextLengthExceeded:
    return ContextLengthExceeded(
        f"This model's maximum context length is {context} tokens. However, your messages hold {holds}. "
        "Please reduce the length of the messages.",
        param="messages",
    )


def check_model_and_n(engine: Engine, settings: Settings, model: str, n: int) -> None:
    """Refuse a request for another model (404) or for more choices than allowed (400)."""
    if model != engine.model_id:
        raise ModelNotFound(f"The model `{model}` does not exist.", param="model")
    if n > settings.max_n:
        raise InvalidRequest(f"n must be at most {settings.max_n}", param="n")


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
