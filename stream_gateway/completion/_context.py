"""Token-exact prompts for continued conversations (contracts T2 and T3 of docs/sessions.md).

When a request continues a known turn, its prompt is that turn's prompt ids, then the ids the
engine sampled for it, then only the *new* messages tokenized as the chat template renders them at
that position. The echoed assistant message is never re-tokenized, however the client
re-serialised it.

Finding "the new messages as rendered at that position" uses the template itself::

    base = render(context,               no generation prompt)  # the parent's prompt, less its generation prompt
    upto = render(context + [assistant], no generation prompt)
    full = render(all messages,          generation prompt)

``upto`` must start with ``base`` and ``full`` with ``upto`` (the template is *prefix-stable* at
this boundary). How the template would render the assistant message itself does not matter: the
sampled ids stand in for it. The new text is ``full[len(upto):]``, preceded by whatever of the template's
end-of-turn marker the model did not sample itself (``"\\n"`` after a sampled ``<|im_end|>``,
all of ``"<|im_end|>\\n"`` after a turn cut by ``max_tokens``).

Agent-sized turns (docs/performance.md). A continuing turn tokenizes only what it adds, never the
whole conversation again. ``matches_full_render`` (does the prompt equal a fresh tokenization of
the whole render?) is carried from turn to turn by a :class:`RenderAnchor`: the render's text up to
its last special token (the generation prompt's ``<|im_start|>``), as a digest, with how many
prompt ids it took and whether they equal that text's tokenization. Fast tokenizers split special
tokens out before anything else, so a text tokenizes as the parts on either side of one (checked
once per tokenizer, :func:`_splits_at_special_tokens`); a continuation whose render still starts
with its parent's anchored text then only tokenizes the text after it. A turn without a usable
anchor (a session's first turn, a turn loaded from the shared store, images, a template without
special tokens) tokenizes the full render once: a *cold* build, counted.

Templates that are not prefix-stable (templates that render the system prompt differently as
the conversation grows) fail that check: the request then starts a new root turn from a full
render. Tokens are never spliced where the text does not line up.

Reasoning models (docs/reasoning.md). Clients drop, echo, summarise or re-shape the model's
thinking; none of that is compared (:mod:`._fingerprint`), and the sampled ids (thinking
included) stand in for the assistant message. To render the history, every assistant message of
the chain gets its *recorded* thinking as ``reasoning_content``, whatever the client echoed, so
the renders above agree with what was sampled. Qwen3-style templates then stay prefix-stable
through a tool loop, and drop earlier thinking only at a new user message: there the texts differ
by thinking blocks alone, and ``--reasoning-history`` decides. ``keep`` continues the chain (the
prompt is the parent's ids, the sampled ids, then the new messages as the template renders them:
``matches_full_render`` is false, honestly); ``template`` starts a new root from the full render,
linked to the parent as its ``predecessor`` with the reason recorded.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Concatenate, ParamSpec

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from stream_gateway._errors import InvalidRequest
from stream_gateway.completion._images import RequestImages, expand_placeholders, placeholder_spans
from stream_gateway.completion._kept import KeptHistory, RenderReuse
from stream_gateway.completion._prompt import template_message
from stream_gateway.completion._request import Message, Tool
from stream_gateway.completion._template import ChatTemplate
from stream_gateway.reasoning import ReasoningFormat
from stream_gateway.sessions import RenderAnchor, Turn, prompt_after

_PROBE = "\u2063probe\u2063"


@dataclass(frozen=True, slots=True)
class Context:
    """The prompt for one request and where it came from."""

    prompt_ids: Sequence[int]  # a continuation's: TokenIds sharing its parent's (no Python int made per id)
    parent: Turn | None
    reused_prompt_tokens: int
    matches_full_render: bool
    fallback_reason: str | None = None  # why a matched parent could not be continued
    predecessor: Turn | None = None  # that parent (the new root is linked to it)
    continues: Turn | None = None  # a root after the client compacted its history: the turn it carries on
    anchor: RenderAnchor | None = None  # for this turn's continuations (None: they build cold)
    anchor_state: Any = None  # the anchor's hash state at its ``chars`` (kept in memory: see _kept.py)
    cold: bool = True  # the whole render was tokenized (False: only what the turn adds)
    tokenized_chars: int = 0  # characters the build tokenized (gateway_context_tokenized_chars_total)
    rendered_messages: int = -1  # messages a recorded render ran the template for (-1: not recorded)


_P = ParamSpec("_P")

_TAIL_CHARS = 256  # tails longer are not kept (a marker early in a message: rare, and long)
_TAILS_KEPT = 64
_PIECES_CHARS = 4 << 20  # characters of render pieces kept tokenized (a few agents' system prompts and tools)
_PIECES_SEEN = 8192  # pieces seen once, remembered (by hash) so that a second sighting keeps them


class RenderPieces:
    """A whole render tokenized piece by piece, the pieces seen before from memory.

    The pieces are the text before the template's first special token and from each one to the
    next (a message's ``<|im_start|>system ...``, its ``<|im_end|>``): the tokenizer splits at
    special tokens before anything else, so the pieces' ids, joined, are the render's
    (:func:`_splits_at_special_tokens` checks this once per tokenizer, as the anchors need it too).
    A new session of an agent starts with the system prompt and tool schemas every session of
    that agent sends: a piece is kept once seen twice (a message seen once is likely never seen
    again), so from the third session on only its own messages are tokenized; least recently used
    out first, up to ``_PIECES_CHARS`` characters. Runs of pieces not kept are tokenized together.
    Thread-safe: renders are tokenized on worker threads too."""

    __slots__ = ("_chars", "_encode", "_kept", "_lock", "_seen", "_split")

    def __init__(self, encode: Callable[[str], list[int]], markers: Sequence[str]) -> None:
        self._encode = encode
        self._split = re.compile("|".join(re.escape(m) for m in sorted(markers, key=len, reverse=True)))
        self._kept: OrderedDict[str, array[int]] = OrderedDict()  # 4 bytes an id
        self._seen: OrderedDict[int, None] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def encode(self, text: str) -> list[int]:
        """``text`` tokenized: what ``encode(text)`` gives."""
        starts = [m.start() for m in self._split.finditer(text)]
        if not starts:
            return self._encode(text)
        if starts[0] != 0:
            starts.insert(0, 0)
        starts.append(len(text))
        ids: list[int] = []
        run = -1  # where the pieces not kept started (-1: none waiting)
        for start, end in itertools.pairwise(starts):
            piece = text[start:end]
            known = self._known(piece)
            if known is None:
                if run < 0:
                    run = start
                continue
            if run >= 0:
                ids += self._encode(text[run:start])
                run = -1
            ids.extend(known)
        if run >= 0:
            ids += self._encode(text[run:])
        return ids

    def _known(self, piece: str) -> Sequence[int] | None:
        """The piece's ids if kept; else ``None``, after keeping it if this is its second sighting."""
        with self._lock:
            kept = self._kept.get(piece)
            if kept is not None:
                self._kept.move_to_end(piece)
                return kept
            digest = hash(piece)
            if digest not in self._seen:
                self._seen[digest] = None
                if len(self._seen) > _PIECES_SEEN:
                    self._seen.popitem(last=False)
                return None
        ids = self._encode(piece)  # seen before: kept from now on
        with self._lock:
            if len(piece) <= _PIECES_CHARS // 4 and piece not in self._kept:
                self._kept[piece] = array("i", ids)
                self._chars += len(piece)
                while self._chars > _PIECES_CHARS:
                    old, _ = self._kept.popitem(last=False)
                    self._chars -= len(old)
        return ids


def _counting_tokenized(
    build: Callable[Concatenate[ContextBuilder, _P], Context],
) -> Callable[Concatenate[ContextBuilder, _P], Context]:
    """``build``, its context carrying the characters it tokenized (counted per thread: builds
    run on worker threads, one build a thread at a time)."""

    @functools.wraps(build)
    def counted(self: ContextBuilder, /, *args: _P.args, **kwargs: _P.kwargs) -> Context:
        self._counted.chars = 0
        self._counted.rendered = -1
        context = build(self, *args, **kwargs)
        return replace(context, tokenized_chars=self._counted.chars, rendered_messages=self._counted.rendered)

    return counted


class ContextBuilder:
    """Builds prompts for one tokenizer and its chat template."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, reasoning: ReasoningFormat | None = None, history: str = "keep"
    ) -> None:
        if tokenizer.chat_template is None:
            raise InvalidRequest("the served model has no chat template; chat completions need one")
        self._tokenizer = tokenizer
        self._tokenize = text_encoder(tokenizer)
        self._template = ChatTemplate(tokenizer)
        self._reasoning = reasoning
        self._history = history
        # A turn's thinking as text, by turn id: every continuation renders its whole chain with it.
        self._thoughts: dict[str, str] = {}
        self._thinking_block = (
            re.compile(re.escape(reasoning.start_tag) + r"[\s\S]*?" + re.escape(reasoning.end_tag) + r"\n*")
            if reasoning is not None
            else None
        )
        self._turn_end = self._probe_turn_end()
        self._counted = threading.local()  # characters tokenized by the build running on this thread
        # The text after a render's last marker (the generation prompt, "<|im_start|>assistant\n"),
        # tokenized: a handful of texts, tokenized again by every build to check the render's anchor.
        self._tails: dict[str, list[int]] = {}
        self._markers = self._template_markers()
        self._splits = bool(self._markers) and _splits_at_special_tokens(self._encode, self._markers)
        self._pieces = RenderPieces(self._encode, self._markers) if self._splits else None
        self._end_ids = {
            int(i)
            for i in (tokenizer.convert_tokens_to_ids(t) for t in tokenizer.all_special_tokens)
            if isinstance(i, int)
        }

    @_counting_tokenized
    def build(
        self,
        messages: Sequence[Message],
        tools: Sequence[Tool] | None,
        parent: Turn | None,
        lineage: Mapping[int, Turn] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        images: RequestImages | None = None,
        history: KeptHistory | None = None,
    ) -> Context:
        """The prompt for ``messages``, continuing ``parent`` (a turn they extend) when possible.

        ``lineage`` maps the position of each assistant message of the chain to its recorded turn
        (the parent and its ancestors), whose thinking the history is rendered with. ``images``:
        the messages' processed images; each placeholder the template renders is expanded to its
        image's tokens (the parent's, already expanded in its ids, are not expanded again).
        ``history``: the request's kept history (``_kept.py``): the messages as the template takes
        them and the recorded render of the request it continues are reused, and this request's
        are kept for the next.
        """
        specs = _tool_specs(tools)
        kept = history if history is not None and self._reasoning is None and images is None else None
        rendered = self._template_messages(messages, kept)
        if self._reasoning is not None and lineage:
            for position, turn in lineage.items():
                message = rendered[position] if position < len(rendered) else None
                if message is not None and message["role"] == "assistant":
                    message["reasoning_content"] = self.thought(turn)
                    content = message["content"]
                    if isinstance(content, str) and self._reasoning.end_tag in content:
                        # thinking echoed inline: the recorded thinking replaces it, not joins it
                        message["content"] = content.rpartition(self._reasoning.end_tag)[2].lstrip("\n")
        kwargs = dict(template_kwargs or {})
        full, reuse = self._full_render(rendered, specs, kwargs, kept)
        # With images the placeholders expand by the processor's counts: always a full tokenization.
        full_ids = self._full_ids(full, images) if images is not None else None
        if parent is None:
            return self._cold(full, full_ids, None)
        k = parent.context_length
        if full_ids is None and self._reasoning is None and k < len(rendered):
            quick = self._continue_from_anchor(full, parent, rendered[k], reuse)
            if quick is not None:
                return quick

        def new_root(reason: str) -> Context:
            return replace(self._cold(full, full_ids, None), fallback_reason=reason, predecessor=parent)

        try:
            base = self._render(rendered[:k], specs, generation=False, **kwargs)
            upto = self._render(rendered[: k + 1], specs, generation=False, **kwargs)
        except InvalidRequest:
            return new_root("the template cannot render the shorter conversation")
        if not (upto.startswith(base) and upto.endswith(self._turn_end)):
            return new_root("the chat template is not prefix-stable here")
        # Where the text the prompt's new ids stand for starts in ``full`` (None: not there).
        known: int | None = len(upto)
        if full.startswith(upto):
            tail = full[len(upto) :]
        else:
            known = None
            without = self._tail_without_thinking(upto, full)
            if without is None:
                return new_root("the chat template is not prefix-stable here")
            tail = without
            if self._history == "template":
                return new_root("reasoning_history=template: the chat template drops earlier thinking here")
        sampled = parent.output_ids
        bridge = self._bridge(sampled)
        reused = len(parent.prompt_ids) + len(sampled)
        prompt = _continuation(parent, reused, self._encode(bridge + tail), images, k)
        if prompt is None:
            return new_root("the conversation's images do not line up with the template's placeholders")
        if full_ids is None:
            tail_at = None
            if known is not None and self._splits and tail.startswith(self._markers):
                # The new ids are the bridge's, then the tail's own (tokenized apart at its marker).
                tail_at = (known, reused + len(self._encode(bridge)))
            warm = self._warm_anchor(full, prompt, parent.render_anchor, tail_at)
            if warm is not None:
                return Context(prompt, parent, reused, warm[0].exact, anchor=warm[0], anchor_state=warm[1], cold=False)
        return replace(self._cold(full, full_ids, prompt), parent=parent, reused_prompt_tokens=reused)

    def _template_messages(self, messages: Sequence[Message], history: KeptHistory | None) -> list[dict[str, Any]]:
        """The messages as the template takes them: those of the request ``history`` continues
        are reused, the very objects (a recorded render replays only for those)."""
        if history is None:
            return [template_message(m) for m in messages]
        return history.each("templated", messages, template_message)

    def _full_render(
        self, rendered: list[dict[str, Any]], specs: Any, kwargs: dict[str, Any], history: KeptHistory | None
    ) -> tuple[str, RenderReuse | None]:
        """The whole conversation rendered with the generation prompt; with ``history``, recorded
        (replaying the earlier request's render where the template allows, ``_replay.py``), and
        what :meth:`_anchored` needs to check the parent's anchor without hashing the history."""
        record, reuse = None, None
        if history is not None:
            try:
                record, reuse = history.recorded_render(
                    lambda earlier: self._template.render_recorded(rendered, specs, True, earlier, **kwargs)
                )
            except TemplateError as exc:
                raise InvalidRequest(f"the chat template rejected the messages: {exc}", param="messages") from exc
        if record is None:
            return self._render(rendered, specs, generation=True, **kwargs), None
        self._counted.rendered = record.rendered
        return record.text, reuse

    def _anchored(self, full: str, anchor: RenderAnchor, reuse: RenderReuse | None) -> Any:
        """A hasher fed ``full[:anchor.chars]`` when that text is the one ``anchor`` covers (None: it
        is not). With ``reuse`` (the earlier request's anchor, its hash state, its render, and how
        far this render is known to equal it) only the text after the known part is compared."""
        if reuse is not None:
            earlier, state, text, same = reuse
            chars = anchor.chars
            if earlier is anchor and same <= chars <= len(text) and full[same:chars] == text[same:chars]:
                return state.copy()
        hasher = _text_hasher(full[: anchor.chars])
        return hasher if hasher.digest() == anchor.digest else None

    def _continue_from_anchor(
        self, full: str, parent: Turn, assistant: Mapping[str, Any], reuse: RenderReuse | None = None
    ) -> Context | None:
        """The continuation from one render, when ``parent``'s anchor allows (``None``: it does not,
        and the caller takes the general path, which renders the shorter conversations too).

        The render must start with the text the parent's anchor covers (its own render up to its
        generation prompt: the template rendered the history before the parent's answer as it did
        then); the parent's answer ends at the first end-of-turn marker after it, and the new
        messages start there with a special token. Not for thinking models (whether the template
        dropped earlier thinking needs the shorter renders), nor for an answer whose own text spells
        a special token (where it ends would be ambiguous)."""
        anchor = parent.render_anchor
        if anchor is None or not self._splits or not self._turn_end or _spells_marker(assistant, self._markers):
            return None
        end = full.find(self._turn_end, anchor.chars)
        if end < 0:
            return None
        known = end + len(self._turn_end)
        tail = full[known:]
        if not tail.startswith(self._markers) or known > self._last_marker(full):
            return None
        hasher = self._anchored(full, anchor, reuse)
        if hasher is None:
            return None
        sampled = parent.output_ids
        bridge = self._bridge(sampled)
        reused = len(parent.prompt_ids) + len(sampled)
        prompt = prompt_after(parent, reused, self._encode(bridge + tail))
        warm = self._warm_anchor(full, prompt, anchor, (known, reused + len(self._encode(bridge))), hasher)
        if warm is None:
            return None
        return Context(prompt, parent, reused, warm[0].exact, anchor=warm[0], anchor_state=warm[1], cold=False)

    def _bridge(self, sampled: Sequence[int]) -> str:
        """The end-of-turn text the model did not sample itself (all of it after a turn cut short)."""
        if sampled and sampled[-1] in self._end_ids:
            end_text = str(self._tokenizer.decode([sampled[-1]]))
            if self._turn_end.startswith(end_text):
                return self._turn_end[len(end_text) :]
        return self._turn_end

    def _encode_render(self, full: str) -> list[int]:
        """A whole render tokenized, the pieces seen before from memory (:class:`RenderPieces`)."""
        return self._encode(full) if self._pieces is None else self._pieces.encode(full)

    def _full_ids(self, full: str, images: RequestImages | None) -> list[int]:
        """The full render tokenized, its image placeholders expanded."""
        ids = self._encode_render(full)
        if images is None:
            return ids
        try:
            return expand_placeholders(ids, images.all(), images.token_id)
        except ValueError as exc:
            raise InvalidRequest(
                f"{exc}: a message's text spells the model's image placeholder", param="messages"
            ) from exc

    def _cold(self, full: str, full_ids: list[int] | None, prompt: Sequence[int] | None) -> Context:
        """A context from the whole render tokenized: ``prompt`` (a continuation's) compared with
        it, or ``None`` for a new root, whose prompt it is."""
        if full_ids is None:
            full_ids = self._encode_render(full)
        own = prompt if prompt is not None else full_ids
        anchor = state = None
        cut = self._last_marker(full)
        if cut > 0 and len(own) == len(full_ids):
            after = self._tail_ids(full[cut:])
            tokens = len(full_ids) - len(after)
            if tokens >= 0 and full_ids[tokens:] == after and own[tokens:] == after:
                exact = own is full_ids or own[:tokens] == full_ids[:tokens]
                state = _text_hasher(full[:cut])
                anchor = RenderAnchor(cut, tokens, state.digest(), exact)
        return Context(own, None, 0, own == full_ids, anchor=anchor, anchor_state=state, cold=True)

    def _warm_anchor(
        self,
        full: str,
        prompt: Sequence[int],
        parent: RenderAnchor | None,
        tail_at: tuple[int, int] | None,
        checked: Any = None,
    ) -> tuple[RenderAnchor, Any] | None:
        """This turn's anchor from its parent's, tokenizing only the text after the parent's anchor
        (``None``: the render no longer starts with the parent's anchored text, or the ids do not
        line up; the caller then tokenizes the whole render), with the hash state at its end.
        ``tail_at``: ``(chars, index)`` when
        ``full[chars:]`` is known to tokenize as ``prompt[index:]`` (the new messages): only the
        text between the parent's anchor and them (its generation prompt, the assistant message,
        the end of turn) is tokenized to compare, not the new messages a second time. ``checked``:
        a hasher already fed ``full[:parent.chars]`` and found to match."""
        if parent is None or not self._splits:
            return None
        cut = self._last_marker(full)
        if cut < parent.chars:
            return None
        hasher = checked if checked is not None else _text_hasher(full[: parent.chars])
        if checked is None and hasher.digest() != parent.digest:
            return None
        after = self._tail_ids(full[cut:])
        tokens = len(prompt) - len(after)
        if tokens < parent.tokens or prompt[tokens:] != after:
            return None
        if tail_at is not None and parent.chars <= tail_at[0] <= cut and parent.tokens <= tail_at[1] <= tokens:
            chars, index = tail_at
            exact = parent.exact and prompt[parent.tokens : index] == self._encode(full[parent.chars : chars])
        else:
            exact = parent.exact and prompt[parent.tokens : tokens] == self._encode(full[parent.chars : cut])
        hasher.update(full[parent.chars : cut].encode("utf-8", "surrogatepass"))
        return RenderAnchor(cut, tokens, hasher.digest(), exact), hasher

    def _last_marker(self, text: str) -> int:
        """Where the last special token of the template's in ``text`` starts (-1: none, or the
        tokenizer does not split at them)."""
        if not self._splits:
            return -1
        return max(text.rfind(marker) for marker in self._markers)

    def thought(self, turn: Turn) -> str:
        """A recorded turn's thinking as text (tags and their newlines left out; ``""``: none)."""
        if self._reasoning is None or not turn.reasoning_tokens:
            return ""
        cached = self._thoughts.get(turn.turn_id)
        if cached is not None:
            return cached
        tags = (self._reasoning.start_id, self._reasoning.end_id)
        ids = [t for t in turn.output_ids[: turn.reasoning_tokens] if t not in tags]
        text = str(self._tokenizer.decode(ids, skip_special_tokens=False)).strip("\n")
        if len(self._thoughts) >= _THOUGHTS_KEPT:
            self._thoughts.clear()  # a bound, not an LRU: a continuation re-decodes at most its own chain
        self._thoughts[turn.turn_id] = text
        return text

    def _tail_without_thinking(self, upto: str, full: str) -> str | None:
        """What ``full`` renders after the last message of ``upto``, when the two differ only by
        thinking blocks the template dropped (a new user message under a Qwen3-style template);
        ``None`` when they differ otherwise, or the new messages themselves hold a thinking block."""
        if self._thinking_block is None:
            return None
        short, long = self._thinking_block.sub("", upto), self._thinking_block.sub("", full)
        if not long.startswith(short):
            return None
        tail = long[len(short) :]
        return tail if full.endswith(tail) else None

    def render_ids(
        self, messages: Sequence[Message], tools: Sequence[Tool] | None, images: RequestImages | None = None
    ) -> list[int]:
        """A fresh full render of ``messages`` with the generation prompt, tokenized (images expanded)."""
        full = self._render([template_message(m) for m in messages], _tool_specs(tools), generation=True)
        return self._full_ids(full, images)

    def _render(self, messages: list[dict[str, Any]], tools: Any, *, generation: bool, **kwargs: Any) -> str:
        try:
            return self._template.render(messages, tools, generation, **kwargs)
        except TemplateError as exc:
            # Templates raise for conversations they cannot render (e.g. roles out of order).
            raise InvalidRequest(f"the chat template rejected the messages: {exc}", param="messages") from exc

    def _encode(self, text: str) -> list[int]:
        ids = self._tokenize(text, False)
        self._counted.chars = getattr(self._counted, "chars", 0) + len(text)
        return ids

    def _tail_ids(self, text: str) -> list[int]:
        """``text`` (what follows a render's last marker) tokenized, from a small cache: the same few
        texts end every render, and tokenizing one again costs a build ~20 us (read only: callers
        compare, never change it)."""
        ids = self._tails.get(text)
        if ids is None:
            ids = self._encode(text)
            if len(text) <= _TAIL_CHARS and len(self._tails) < _TAILS_KEPT:
                self._tails[text] = ids
        return ids

    def _template_markers(self) -> tuple[str, ...]:
        """The special tokens the chat template writes (``<|im_start|>``, ``<|im_end|>``)."""
        conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}]
        text = self._render(conversation, None, generation=False)
        text += self._render(conversation[:1], None, generation=True)
        special = {token.content for token in self._tokenizer.added_tokens_decoder.values() if token.special}
        special.update(self._tokenizer.all_special_tokens)
        return tuple(sorted(marker for marker in special if marker and marker in text))

    def _probe_turn_end(self) -> str:
        """The text a template puts after an assistant message's content (``"<|im_end|>\\n"``)."""
        conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}]
        text = self._render(conversation, None, generation=False)
        return text[text.rindex(_PROBE) + len(_PROBE) :]


def text_encoder(tokenizer: PreTrainedTokenizerBase) -> Callable[[str, bool], list[int]]:
    """``encode(text, add_special_tokens)``: the ids ``tokenizer.encode`` gives, from a fast
    tokenizer's Rust backend directly while it is set up as ``encode`` sets it for such a call (no
    truncation, no padding, special tokens recognised as such).

    ``encode`` goes through ``encode_batch`` and a ``BatchEncoding``: per call, 41 us against 28 for
    a short chat prompt and 19 against 7 for a template's last marker (transformers 5.10.4,
    tokenizers 0.22.2, read), and a new conversation's prompt is tokenized twice. Anything else
    (a slow tokenizer, ``split_special_tokens``, truncation left on the backend) takes ``encode``.
    """
    backend = tokenizer.backend_tokenizer if getattr(tokenizer, "is_fast", False) else None
    if backend is None or getattr(tokenizer, "split_special_tokens", False):

        def through_transformers(text: str, special: bool) -> list[int]:
            ids: list[int] = tokenizer.encode(text, add_special_tokens=special)
            return ids

        return through_transformers

    def encode(text: str, special: bool) -> list[int]:
        if backend.truncation is None and backend.padding is None and not backend.encode_special_tokens:
            ids: list[int] = backend.encode(text, add_special_tokens=special).ids
        else:
            ids = tokenizer.encode(text, add_special_tokens=special)
        return ids

    return encode


def _continuation(
    parent: Turn, reused: int, added: list[int], images: RequestImages | None, k: int
) -> Sequence[int] | None:
    """A continuation's prompt: ``added`` packed on ``parent``'s storage (no Python int made per
    id of the history), or with images a list whose new placeholders are expanded (``None``: they
    do not line up with the images)."""
    if images is None:
        return prompt_after(parent, reused, added)
    prompt = [*parent.prompt_ids, *parent.output_ids, *added]
    return prompt if _expand_new_images(prompt, reused, images, k) else None


def _expand_new_images(prompt: list[int], reused: int, images: RequestImages, position: int) -> bool:
    """Expand, in place, the placeholders after ``reused`` (those of the messages after ``position``;
    the reused ids hold theirs expanded already); whether every image then has its run of tokens."""
    try:
        prompt[reused:] = expand_placeholders(prompt[reused:], images.after(position), images.token_id)
    except ValueError:
        return False
    spans = placeholder_spans(prompt, images.token_id)
    expected = images.all()
    return len(spans) == len(expected) and all(n == image.tokens for (_, n), image in zip(spans, expected, strict=True))


def _splits_at_special_tokens(encode: Callable[[str], list[int]], markers: Sequence[str]) -> bool:
    """Whether ``encode`` tokenizes a text as the parts before and from each special token, probed
    on texts around each marker (fast and slow tokenizers split added tokens out first; a
    normalizer or pre-tokenizer that reaches across them would fail here, and the builder then
    tokenizes whole renders)."""
    befores = ("", "hello", " world\n", "\n\n", "a  b ", "\u00e9t\u00e9", "}")
    afters = ("", "assistant\n", "\nnext", " spaced", "x", "\n\n\n")
    for marker in markers:
        for before in befores:
            for after in afters:
                if encode(before + marker + after) != encode(before) + encode(marker + after):
                    return False
    return True


def _spells_marker(message: Mapping[str, Any], markers: Sequence[str]) -> bool:
    """Whether a template message's text (content, tool calls) holds a special token's spelling."""
    text = str(message.get("content") or "") + str(message.get("tool_calls") or "")
    return any(marker in text for marker in markers)


def _text_hasher(text: str) -> Any:
    """A render anchor's hasher, fed ``text`` (it goes on to cover a continuation's text too)."""
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16)


_THOUGHTS_KEPT = 8192  # decoded thoughts kept by ContextBuilder.thought

# Below this much message text (and without tools), a prompt is built on the event loop: the
# render and tokenization then cost less than the hop to a worker thread and back (~0.1-0.3 ms,
# more when the machine is idle), and they hold the GIL either way. Measured on the tiny model's
# tokenizer: ~0.17 ms for 40 characters, ~0.4 ms for 500; 2,000 take 1.1 ms and go to a thread.
INLINE_BUILD_CHARS = 512


def cheap_to_build(messages: Sequence[Message], tools: Sequence[Tool] | None, parent: Turn | None) -> bool:
    """Whether :meth:`ContextBuilder.build` for these is cheap enough to run on the event loop."""
    if tools or parent is not None:  # tool schemas render long; a continuation renders three times
        return False
    budget = INLINE_BUILD_CHARS
    for message in messages:
        if message.tool_calls:
            return False
        budget -= len(message.text())
        if budget < 0:
            return False
    return True


# What a template sets itself or is always given: never a request's to set.
_RENDER_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "documents", "bos_token", "eos_token"})


def template_variables(tokenizer: PreTrainedTokenizerBase) -> frozenset[str]:
    """The undeclared names of the chat template a request's ``chat_template_kwargs`` may set."""
    from jinja2 import Environment, meta

    template = tokenizer.chat_template
    if not isinstance(template, str):
        return frozenset()
    names = meta.find_undeclared_variables(Environment().parse(template))
    return frozenset(names - _RENDER_VARIABLES - {"raise_exception", "strftime_now", "range", "namespace"})


def _tool_specs(tools: Sequence[Tool] | None) -> Any:
    return [tool.model_dump(exclude_none=True) for tool in tools] if tools else None
