"""Preparing a request: admit it, place it in a session, build its token-exact prompt.

Two shapes of request reach the core: chat-shaped ones (chat completions, and Messages and
Responses translated at their edges), whose prompt the chat template renders from messages and
whose continuation is found by conversation keys; and token-in ones (vLLM's ``/v1/completions``),
whose prompt ids the client gives and whose continuation is found by id prefix. Both pass the
same :class:`~._admission.Admission` and open sessions the same way, and both end as
:class:`PreparedCompletion` objects the token loop runs.
"""

from __future__ import annotations

import logging
import re
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

import anyio
from transformers import PreTrainedTokenizerBase

from stream_gateway._errors import Conflict, InvalidRequest, UnsupportedParameter
from stream_gateway._metrics import GatewayMetrics
from stream_gateway._settings import Settings
from stream_gateway.capture import EventRecorder
from stream_gateway.completion._admission import Admission, SamplingRequest
from stream_gateway.completion._context import (
    Context,
    ContextBuilder,
    cheap_to_build,
    template_variables,
    text_encoder,
)
from stream_gateway.completion._fingerprint import conversation_keys
from stream_gateway.completion._images import ImageResolver, PromptImage, RequestImages, prompt_images
from stream_gateway.completion._kept import KeptHistory
from stream_gateway.completion._request import ChatCompletionRequest, Message
from stream_gateway.completion._signals import edit_key, request_signals
from stream_gateway.constraints import Constraint, response_format_constraint, tool_choice_constraint
from stream_gateway.constraints import check as check_grammar
from stream_gateway.engines import Engine, SamplingParams
from stream_gateway.reasoning import ReasoningFormat, resolve_reasoning_format
from stream_gateway.sessions import Session, SessionDirectory, Turn, TurnSignal, scope_of

__all__ = ["PreparedCompletion", "Preparer", "TokenInRequest"]

log = logging.getLogger(__name__)

MAX_BATCH = 64  # prompts per token-in request


_TOOLS_DROPPED = (
    "the served model's chat template leaves tools out of the prompt: the model never sees the request's tools "
    "(serve a model whose template renders them, e.g. tiny-agent or Qwen)"
)


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
    prompt_ids: Sequence[int]  # a continuation's packed on its parent's (sessions.TokenIds)
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
    reasoning: ReasoningFormat | None = None  # the model's thinking tags (None: no reasoning parser)
    split_reasoning: bool = True  # thinking streams apart from the answer (token-in: raw text, split only recorded)
    return_routes: bool = False  # the final update carries the routed experts (token-in ``return_routed_experts``)
    routes_from: int = 0  # ... from this position on
    images: tuple[PromptImage, ...] = ()  # vision-language models: the prompt's images and where they sit
    warnings: tuple[str, ...] = ()  # what the client should know (the template dropped its tools...)
    head: bytes | None = None  # key of (tools, system message): a conversation's identity across compaction
    max_tokens_requested: int | None = None  # what the client asked for (None: nothing); params.max_tokens fits it
    kept: KeptHistory | None = None  # token-in: the kept prompt, told the turn it makes (completion/_kept.py)
    signals: tuple[TurnSignal, ...] = ()  # what the request says about earlier turns (completion/_signals.py)
    edit_key: bytes | None = None  # key of the messages before a last user message (an edit keeps them)


@dataclass(frozen=True, slots=True)
class TokenInRequest:
    """A token-in request in the core's terms: prompts (ids, or text to encode) and sampling."""

    model: str
    n: int
    prompts: list[str | list[int]]
    add_special_tokens: bool
    sampling: SamplingRequest
    stops: tuple[str, ...]
    logprobs: bool
    return_token_ids: bool
    include_usage: bool
    return_routes: bool = False  # vLLM's and SGLang's ``return_routed_experts``
    routes_from: int = 0  # their ``routed_experts_prompt_start`` / ``routed_experts_start_len``
    routes_param: str = "routed_experts_start_len"  # the name the client gave it (for errors)
    history: KeptHistory | None = None  # the kept prompt this one repeats (completion/_kept.py)


class Preparer:
    """Turns validated requests into :class:`PreparedCompletion` objects."""

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
        self._vocab: int | None = None  # the tokenizer's size, once asked (token-in prompts)
        self._tokenize: Callable[[str, bool], list[int]] | None = None  # text prompts' (text_encoder)
        self.admission = Admission(engine, settings)

    @cached_property
    def _context_builder(self) -> ContextBuilder:
        # Lazily: the engine's tokenizer exists only once the engine has started.
        return ContextBuilder(self._engine.tokenizer, self.reasoning, self._settings.reasoning_history)

    @cached_property
    def _tool_error(self) -> re.Pattern[str]:
        return re.compile(self._settings.tool_error_pattern)

    @cached_property
    def images(self) -> ImageResolver:
        """The request's images, processed by the served model's own processor (lazily, like the
        context builder: the engine's processor exists once it has started)."""
        engine = self._engine
        return ImageResolver(engine.vision, self._settings, engine.model_id, self._metrics, engine.remote)

    @cached_property
    def reasoning(self) -> ReasoningFormat | None:
        """The served model's thinking format (``--reasoning-parser``; ``auto`` is chosen and logged
        here). Resolved once the engine has started; the app asks at start so a bad choice fails it."""
        return resolve_reasoning_format(self._settings.reasoning_parser, self._engine.tokenizer)

    # -- chat-shaped requests --------------------------------------------------------------------

    async def chat(
        self,
        body: ChatCompletionRequest,
        *,
        tenant: str,
        session_id: str | None = None,
        agent: str | None = None,
        adapter: str | None = None,
        captured: bool = True,
    ) -> PreparedCompletion:
        """Validate ``body``, place it in a session, and build its token-exact prompt.

        With ``session_id`` the request belongs to that session (created on first use);
        without, it joins the tenant's session whose conversation it continues, or a new one.
        ``agent`` (the User-Agent) goes into the ``session.opened`` event. ``adapter``: the LoRA
        adapter the tenant's key is bound to (else ``body.model`` names the base or an adapter).
        ``captured`` False: its user did not consent; it joins or opens an uncaptured session only.
        """
        arrived = time.perf_counter()
        adapter = self.admission.check_model_and_n(body.model, body.n, tenant=tenant, bound=adapter)
        body.check_supported()
        await self._check_size(body)
        history = KeptHistory.of(body)
        images = await self.images.resolve(body.messages, history.known("imageless"))
        history.keep_known("imageless", len(body.messages) if images is None else 0)
        constraint = None
        if body.response_format is not None or isinstance(body.tool_choice, dict) or body.tool_choice == "required":
            constraint = await anyio.to_thread.run_sync(self._constraint, body)
        keys = conversation_keys(body)
        session, parent, unavailable = await self._find_conversation(body, keys, tenant, session_id, captured)
        adapter = _session_adapter(session, adapter)
        signals = request_signals(session, parent, body.messages, keys, self._tool_error)
        context = await self._build_context(body, session, parent, unavailable, session_id, images)
        head = keys[0] if body.messages and body.messages[0].role in ("system", "developer") else None
        if parent is None and session is not None and context.fallback_reason is None and head is not None:
            context = replace(context, continues=compacted_from(session, head, len(context.prompt_ids)))
        if constraint is not None and (fmt := self.reasoning) is not None:  # the answer is held, not the thinking
            opened = fmt.thinking_at_start(context.prompt_ids)
            constraint = constraint.after_thinking(fmt.start_id, fmt.end_id, opened=opened)
        requested = body.requested_max_tokens()
        max_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        room = self.admission.fit(len(context.prompt_ids), requested, noun="messages", max_param=max_param)
        # Only a request that will run gets a session: failed ones leave nothing behind.
        session = await self._admit_session(session, session_id, tenant, agent, body.metadata or {}, captured)
        placed = prompt_images(context.prompt_ids, images)
        if placed and session.captured:  # their bytes are stored before the turn's events refer to them
            self._recorder.images_used([p.image for p in placed], self._engine.vision)
        sampling = SamplingRequest(
            max_tokens=requested,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            seed=body.seed,
            top_logprobs=(body.top_logprobs or 0) if body.logprobs else 0,
            ignore_eos=body.ignore_eos,
        )
        return PreparedCompletion(
            completion_id=f"chatcmpl-{secrets.token_hex(12)}",
            created=int(time.time()),
            arrived=arrived,
            model=self._engine.model_id,
            session=session,
            context=context,
            conversation_key=keys[-1],
            context_length=len(body.messages),
            prompt_ids=context.prompt_ids,
            params=self.admission.params(sampling, room, constraint, adapter),
            n=body.n,
            stops=body.stop_sequences(),
            logprobs=body.logprobs,
            return_token_ids=body.return_token_ids,
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
            tool_parser=self._settings.tool_parser if body.tools and body.tool_choice != "none" else None,
            tool_names=frozenset(t.function.name for t in body.tools or ()),
            legacy_functions=body.legacy_functions,
            reasoning=self.reasoning,
            images=placed,
            warnings=(_TOOLS_DROPPED,) if body.tools and self.template_drops_tools else (),
            head=head,
            max_tokens_requested=requested,
            signals=signals,
            edit_key=edit_key(body.messages, keys),
        )

    async def _find_conversation(
        self, body: ChatCompletionRequest, keys: list[bytes], tenant: str, session_id: str | None, captured: bool
    ) -> tuple[Session | None, Turn | None, str | None]:
        """The session and turn the messages continue, and why the shared state could not say
        whether a deeper turn exists (``None``: it could)."""
        # Turn keys end with an assistant message; the request's last message is always new.
        positions = [i for i, m in enumerate(body.messages[:-1]) if m.role == "assistant"]
        if session_id is None:
            found, unavailable = await self._sessions.find(tenant, keys, positions, captured)
            session, parent = found if found is not None else (None, None)
            return session, parent, unavailable
        session = await self._sessions.lookup(session_id, tenant, captured)
        if session is None:
            return None, None, None
        if session.closed:
            raise Conflict(f"Session `{session_id}` is closed.", param="session_id", code="session_closed")
        parent, unavailable = await self._sessions.match(session, keys, positions)
        return session, parent, unavailable

    async def _build_context(
        self,
        body: ChatCompletionRequest,
        session: Session | None,
        parent: Turn | None,
        unavailable: str | None,
        session_id: str | None,
        images: RequestImages | None = None,
    ) -> Context:
        builder = self._context_builder
        kwargs = self._template_kwargs(body)
        lineage = _lineage(session, parent) if self.reasoning is not None else None
        history = KeptHistory.of(body)
        if images is None and cheap_to_build(body.messages, body.tools, parent):
            context = builder.build(body.messages, body.tools, parent, lineage, kwargs, None, history)
        else:
            context = await anyio.to_thread.run_sync(
                builder.build, body.messages, body.tools, parent, lineage, kwargs, images, history
            )
        history.keep_anchor(context.anchor, context.anchor_state)
        kind = "cold" if context.cold else "warm"
        self._metrics.context_builds.labels(kind).inc()
        self._metrics.context_tokenized_chars.labels(kind).inc(context.tokenized_chars)
        if context.rendered_messages >= 0:
            self._metrics.template_rendered_messages.labels(kind).inc(context.rendered_messages)
        if unavailable is not None and context.fallback_reason is None:
            context = replace(context, fallback_reason=unavailable)
        if context.fallback_reason is not None:
            self._metrics.context_fallbacks.inc()
            log.info("session %s: new root instead of continuing a turn: %s", session_id, context.fallback_reason)
        return context

    def _template_kwargs(self, body: ChatCompletionRequest) -> dict[str, Any] | None:
        """``chat_template_kwargs`` (vLLM's extension): only what the template reads, or a 400."""
        given = body.chat_template_kwargs
        if not given:
            return None
        known = self.template_variables
        for name, value in given.items():
            if name not in known:
                raise InvalidRequest(
                    f"chat_template_kwargs.{name}: the served model's chat template does not read it",
                    param="chat_template_kwargs",
                )
            if name == "enable_thinking" and not isinstance(value, bool):
                raise InvalidRequest(
                    "chat_template_kwargs.enable_thinking must be a boolean", param="chat_template_kwargs"
                )
        return dict(given)

    @cached_property
    def template_drops_tools(self) -> bool:
        """Whether the served model's chat template leaves a request's ``tools`` out of the prompt
        (SmolLM2's does: the model never sees them). Checked once, by rendering a probe tool."""
        probe = {"type": "function", "function": {"name": "stream_gateway_probe_tool", "description": "probe",
                 "parameters": {"type": "object", "properties": {}}}}  # fmt: skip
        try:
            text = self._engine.tokenizer.apply_chat_template(
                [{"role": "user", "content": "hi"}], tools=[probe], tokenize=False, add_generation_prompt=True
            )
        except Exception:  # a template that refuses tools outright: the request says so itself
            return False
        dropped = "stream_gateway_probe_tool" not in str(text)
        if dropped:
            log.warning("model %s: %s", self._engine.model_id, _TOOLS_DROPPED)
        return dropped

    @cached_property
    def template_variables(self) -> frozenset[str]:
        """The names the chat template reads that a request may set (``enable_thinking``, ...)."""
        return template_variables(self._engine.tokenizer)

    async def count_tokens(self, body: ChatCompletionRequest) -> int:
        """The prompt tokens ``body`` would take: a full render of its messages and tools."""
        self.admission.check_model_and_n(body.model, body.n)
        await self._check_size(body)
        images = await self.images.resolve(body.messages)
        builder = self._context_builder
        return len(await anyio.to_thread.run_sync(builder.render_ids, body.messages, body.tools, images))

    async def _check_size(self, body: ChatCompletionRequest) -> None:
        """Refuse at once what cannot fit, before fingerprinting, rendering or tokenizing all of it."""
        self.admission.check_message_count(len(body.messages))
        budget = self.admission.characters_need_counting(_text_characters(body))
        if budget is not None:
            texts = [m.text() for m in body.messages]
            # Suspiciously long: count the tokens of a prefix whose size the context bounds (not
            # the request), off the loop. More tokens than the context there: more in the whole.
            await anyio.to_thread.run_sync(self.admission.check_prefix_tokens, texts, budget)

    def _constraint(self, body: ChatCompletionRequest) -> Constraint | None:
        """What ``response_format`` or ``tool_choice`` holds the output to (in a worker thread:
        the first grammar for a large vocabulary takes a while); 400 if it cannot be enforced."""
        by_format = response_format_constraint(body.response_format)
        tokenizer = self._engine.tokenizer
        by_choice = tool_choice_constraint(
            body.tool_choice,
            body.tools,
            tokenizer,
            self._settings.tool_parser,
            parallel=body.parallel_tool_calls is not False,
        )
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

    # -- token-in requests -----------------------------------------------------------------------

    async def tokens(
        self,
        request: TokenInRequest,
        *,
        tenant: str,
        session_id: str | None = None,
        agent: str | None = None,
        adapter: str | None = None,
        captured: bool = True,
    ) -> list[PreparedCompletion]:
        """One prepared completion per prompt, sharing one response id; choices numbered on
        (``captured``: as for :meth:`chat`)."""
        adapter = self.admission.check_model_and_n(request.model, request.n, tenant=tenant, bound=adapter)
        if len(request.prompts) > MAX_BATCH:
            raise InvalidRequest(f"At most {MAX_BATCH} prompts per request.", param="prompt")
        # A prompt read through a kept one (completion/_kept.py): the ids its request checked
        # (none if that request failed first: a kept body is not a checked one) are not checked again.
        link = request.history if len(request.prompts) == 1 else None
        checked = link.known("checked") if link is not None else 0
        token_lists = [self._prompt_ids(p, request.add_special_tokens, checked) for p in request.prompts]
        if link is not None:
            link.keep_known("checked", len(token_lists[0]))
        if request.return_routes:
            self._check_routes(request, token_lists)
        named: Session | None = None
        if session_id is not None:
            named = await self._sessions.lookup(session_id, tenant, captured)
            if named is not None and named.closed:
                raise Conflict(f"Session `{session_id}` is closed.", param="session_id", code="session_closed")
        requested = request.sampling.max_tokens
        rooms = [self.admission.fit(len(ids), requested, noun="prompt", max_param="max_tokens") for ids in token_lists]
        completion_id = f"cmpl-{secrets.token_hex(12)}"
        created = int(time.time())
        arrived = time.perf_counter()
        batch = []
        for position, (ids, room) in enumerate(zip(token_lists, rooms, strict=True)):
            session, parent = await self._place_tokens(ids, tenant, session_id, named, captured, link)
            if session_id is not None:
                named = session
            session = await self._admit_session(session, session_id, tenant, agent, {}, captured)
            chosen = _session_adapter(session, adapter)
            reused = len(parent.prompt_ids) + len(parent.output_ids) if parent is not None else 0
            batch.append(
                PreparedCompletion(
                    completion_id=completion_id,
                    created=created,
                    arrived=arrived,
                    model=self._engine.model_id,
                    session=session,
                    context=Context(ids, parent, reused, True, cold=False),
                    conversation_key=b"",
                    context_length=0,
                    prompt_ids=ids,
                    params=self.admission.params(request.sampling, room, None, chosen),
                    n=request.n,
                    stops=request.stops,
                    logprobs=request.logprobs,
                    return_token_ids=request.return_token_ids,
                    include_usage=request.include_usage,
                    tool_parser=None,
                    tool_names=frozenset(),
                    first_index=position * request.n,
                    token_in=True,
                    reasoning=self.reasoning,
                    split_reasoning=False,
                    return_routes=request.return_routes,
                    routes_from=request.routes_from,
                    kept=link if link is not None and link.kept and request.n == 1 else None,
                )
            )
        return batch

    def _check_routes(self, request: TokenInRequest, token_lists: list[list[int]]) -> None:
        """Routes need a mixture of experts that records them, and a start within every prompt."""
        if self._engine.experts is None:
            raise InvalidRequest(
                "return_routed_experts: the served model records no routed experts (a dense model, or "
                "routes off: --no-routed-experts)",
                param="return_routed_experts",
            )
        shortest = min(len(ids) for ids in token_lists)
        if not 0 <= request.routes_from <= shortest:
            raise InvalidRequest(
                f"{request.routes_param} must be between 0 and the prompt's length ({shortest}), "
                f"got {request.routes_from}.",
                param=request.routes_param,
            )

    async def _place_tokens(
        self,
        ids: list[int],
        tenant: str,
        session_id: str | None,
        named: Session | None,
        captured: bool,
        link: KeptHistory | None = None,
    ) -> tuple[Session | None, Turn | None]:
        """The session the prompt belongs to (``None``: a new one), and the turn it continues.

        Without a session id, continuation is found among the sessions this replica holds (the
        shared state indexes conversations, not id prefixes): name the session (vLLM's
        ``session_id``, or the session URL) to continue it on any replica. A named session's
        prompt that repeats a kept prompt is checked against the turn that prompt made first
        (``_linked_turn``), with no pass over the ids it repeats.
        """
        if session_id is not None:
            session = named if named is not None else await self._sessions.open(session_id, tenant, captured)
            linked = _linked_turn(session, ids, link)
            self._metrics.token_in_matches.labels("kept" if linked is not None else "ids").inc()
            return session, linked if linked is not None else await self._sessions.match_tokens(session, ids)
        found = self._sessions.store.find_tokens(scope_of(tenant, captured), ids)
        if found is not None:
            return found
        return None, None

    def _prompt_ids(self, prompt: str | list[int], add_special_tokens: bool, checked: int = 0) -> list[int]:
        """The prompt's ids (``checked``: how many leading ids an earlier request had checked)."""
        tokenizer: PreTrainedTokenizerBase = self._engine.tokenizer
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest("The prompt must not be empty.", param="prompt")
            if self._tokenize is None:
                self._tokenize = text_encoder(tokenizer)
            return self._tokenize(prompt, add_special_tokens)
        if self._vocab is None:
            self._vocab = len(tokenizer)  # a fast tokenizer counts its vocabulary anew each time
        vocab = self._vocab
        bad = next((t for t in (prompt[checked:] if checked else prompt) if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest(f"Token id {bad} is out of vocabulary (0..{vocab - 1}).", param="prompt")
        # Not copied: nothing writes into a prompt's ids (engines take immutable TokenIds too), and
        # a kept prompt's list (completion/_kept.py) is only read, to build the next one.
        return prompt

    # -- both --------------------------------------------------------------------------------------

    async def _admit_session(
        self,
        session: Session | None,
        session_id: str | None,
        tenant: str,
        agent: str | None,
        metadata: dict[str, str],
        captured: bool,
    ) -> Session:
        """Open the request's session if it has none yet, announce it once, and ready it for writes."""
        if session is None:
            session = await self._sessions.open(session_id, tenant, captured)
        if session.closed:  # closed while this request's prompt was being built
            raise Conflict(f"Session `{session.session_id}` is closed.", param="session_id", code="session_closed")
        await self._sessions.prepare_to_write(session)
        if not session.announced:
            self._recorder.session_opened(session, self._engine.policy_version, agent, metadata)
        self._sessions.store.touch(session)
        return session


def compacted_from(session: Session, head: bytes, prompt_tokens: int) -> Turn | None:
    """The turn a new root of ``session`` carries on after the client compacted its history: the
    session's latest turn with the same system message and tools (``head``), when the new prompt is
    shorter than that turn's whole context (its history was replaced by something shorter: Claude
    Code's and Codex's compaction, a summary). ``None``: not a compaction (another agent, whose
    system prompt differs; a longer history)."""
    same = [t for t in session.turns.values() if t.head == head]
    if not same:
        return None
    latest = max(same, key=lambda t: t.created_at)
    return latest if prompt_tokens < len(latest.prompt_ids) + len(latest.output_ids) else None


def _lineage(session: Session | None, parent: Turn | None) -> dict[int, Turn]:
    """The parent and its ancestors by the position of their assistant message in the request."""
    out: dict[int, Turn] = {}
    turn = parent
    while turn is not None and session is not None:
        out[turn.context_length] = turn
        turn = session.turns.get(turn.parent_id) if turn.parent_id is not None else None
    return out


def _linked_turn(session: Session, ids: list[int], link: KeptHistory | None) -> Turn | None:
    """The turn a token-in prompt continues, found through the kept prompt it repeats (None: look
    it up by ids): the turn that prompt made, if this one goes on with that turn's sampled ids and
    the session holds no longer sequence that could be a deeper match. The repeated prompt is that
    turn's prompt, byte for byte, so only the sampled ids are compared."""
    if link is None or link.kept_turn is None:
        return None
    turn = session.turns.get(link.kept_turn)
    if turn is None or turn.finish_reason is None:
        return None
    size = len(turn.prompt_ids)
    end = size + len(turn.output_ids)
    if size != link.reused or end > len(ids) or max(session.token_lengths, default=0) > end:
        return None
    return turn if turn.output_ids == ids[size:end] else None


def _text_characters(body: ChatCompletionRequest) -> int:
    """The characters of ``body``'s message texts, the kept history's counted already."""
    counts = KeptHistory.of(body).running("counted", body.messages, 0, _add_text)
    return counts[-1] if counts else 0


def _add_text(total: int, message: Message) -> int:
    return total + len(message.text())


def _session_adapter(session: Session | None, requested: str | None) -> str | None:
    """A session keeps the adapter it started with: its first turn's (``requested`` for a new one)."""
    if session is None or not session.turns:
        return requested
    return next(iter(session.turns.values())).adapter
