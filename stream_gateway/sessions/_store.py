"""Sessions: trees of turns, found by id or by recognising a continued conversation.

A :class:`Turn` is one engine generation: the exact prompt ids fed to the engine, the ids it
sampled with their logprobs, and the assistant message as the client received it. A turn's
``key`` identifies the conversation it closes (its context messages plus its own assistant
message), so a later request whose messages start with that conversation continues it.

A :class:`Session` is a tree: a turn's parent is the turn whose conversation the request
continued; a request that continues nothing opens a new root. Chains (root-to-leaf paths) are what
become training trajectories.

The store is bounded: sessions idle longer than ``idle_seconds`` and, beyond ``max_sessions``,
the least recently used ones are evicted (the event pipeline keeps the durable record; the
store's ``on_close`` callback says why each one went: ``idle`` or ``evicted``).

A closed session (``POST /sessions/{id}/close``) takes no more turns and is no longer found by
automatic lookup, but stays inspectable and accepts feedback until it is evicted.

With shared sessions (:mod:`._shared`) this store is a cache: the session state lives in
NATS, eviction only drops the local copy (``on_evict``), and a session's durable events are
numbered from blocks of ``seq`` values reserved in NATS, so that two replicas writing one
session never use the same number.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pipeline import TokenChain, chain_tokens
from pipeline.routes import chain_routes_rows

from stream_gateway._errors import NotFound
from stream_gateway.sessions._ids import Logprobs, TokenIds
from stream_gateway.tool_parsers import ToolCall

log = logging.getLogger(__name__)

SEQ_BLOCK = 4096  # durable event numbers one replica reserves for one session at a time
_UNRESERVED_FROM = 1 << 40  # where the blocks a replica takes without a reservation start
_UNRESERVED_BLOCKS = 1 << 31  # how many there are (the last ends below 2^44, well inside JSON's 2^53)


@dataclass(frozen=True, slots=True)
class TurnImage:
    """An image of a turn's prompt (vision-language models, docs/images.md): which bytes, where its
    placeholder tokens sit, and what the model's processor made of it."""

    sha256: str  # of the image's bytes: its name in the image store (``images/<sha256>``)
    media_type: str
    width: int
    height: int
    start: int  # its first placeholder token in the prompt
    tokens: int  # placeholder tokens
    grid_thw: tuple[int, int, int]  # the processor's patch grid
    pixels_sha256: str  # of the float32 pixel values the model consumed
    processor: str  # the processor's fingerprint (``processors/<fingerprint>`` in the image store)


@dataclass(frozen=True, slots=True)
class TurnSignal:
    """What a request said about an earlier turn of its session (``retried``, ``edited``,
    ``tool_error``), recorded on the turn that request made (docs/rewards.md)."""

    turn_id: str  # the earlier turn it is about
    signal: str  # "retried", "edited" or "tool_error"
    detail: str | None = None


SIGNAL_ORDER = ("accepted", "retried", "edited", "tool_error", "abandoned")
"""Every implicit signal a turn can carry, in the order they are listed."""


@dataclass(frozen=True, slots=True)
class RenderAnchor:
    """Where a turn's render and its prompt ids line up, for its continuations to start from.

    ``chars`` characters of the turn's full render (up to its last special token) hash to
    ``digest`` and took the first ``tokens`` prompt ids; ``exact``: those ids are that text's own
    tokenization (false once a chain holds ids a fresh render would not: kept thinking, an ancestor
    whose sampled ids tokenize otherwise).
    """

    chars: int
    tokens: int
    digest: bytes
    exact: bool


@dataclass(frozen=True, slots=True)
class Turn:
    """One generation, token-exact."""

    turn_id: str
    session_id: str
    parent_id: str | None
    key: bytes | None  # prefix key of context + assistant message; None: cannot be continued
    context_length: int  # number of request messages that formed the prompt
    # The ids and logprobs are compact (sessions._ids; a tuple or list given is packed): a
    # continuation's prompt shares its parent's storage (prompt_after).
    prompt_ids: TokenIds
    reused_prompt_tokens: int  # leading prompt ids taken verbatim from the parent turn
    output_ids: TokenIds
    logprobs: Logprobs
    finish_reason: str | None  # None: aborted (client gone, engine error)
    content: str
    tool_calls: tuple[ToolCall, ...]  # as sent to the client
    policy_version: int  # the version that sampled the first output token
    policy_versions: tuple[tuple[int, int], ...]  # (version, first output index) spans covering the output
    created_at: float
    time_to_first_token_s: float | None
    duration_s: float
    matches_full_render: bool  # prompt ids equal a fresh tokenization of the full conversation
    fallback_reason: str | None  # why a matching parent could not be continued (a new root instead)
    predecessor_id: str | None = None  # that parent, for a root that could not continue it
    continues_id: str | None = None  # a root after the client compacted its history: the turn it carries on
    cached_prompt_tokens: int | None = None  # prompt tokens the engine reused from its prefix cache (None: unsaid)
    length_cause: str | None = None  # a "length" finish: "max_tokens" (the client's cap) or "context" (the window)
    # The key of its conversation's (tools, system message), in memory only: a root with the same head
    # and a shorter history continues it (completion._prepare.compacted_from).
    head: bytes | None = field(default=None, compare=False)
    reasoning_tokens: int = 0  # the first output ids that are thinking, tags included (stream_gateway.reasoning)
    answer_start: int | None = 0  # output index of the first answer token; None: ended inside thinking
    # Mixture of experts (stream_gateway.moe): the experts that routed the positions this turn
    # ran first, [positions, layers, top_k] from position ``routes_start`` (0 for a root; the
    # parent's last output token for a continuation: earlier rows are the ancestors'). None: dense.
    routes: np.ndarray | None = field(default=None, compare=False)
    routes_start: int = 0
    adapter: str | None = None  # the LoRA adapter that sampled it (docs/adapters.md); None: the base model
    images: tuple[TurnImage, ...] = ()  # every image of the prompt, in order (the reused prefix's too)
    signals: tuple[TurnSignal, ...] = ()  # what its request said about earlier turns (a retry, an edit ...)
    abort_reason: str | None = None  # why it did not finish (turn.aborted's reason); None: it finished
    # The keys of its request's messages and, when the request ended with a user message, of those
    # before it: a later request with the same (a regenerate) or the same before and another last
    # message (an edit) says so (completion._signals). In memory only, like ``head``.
    request_key: bytes | None = field(default=None, compare=False)
    edit_key: bytes | None = field(default=None, compare=False)
    # Where its render and prompt line up, for continuations to tokenize only what they add
    # (completion._context); in memory only: a turn loaded from the shared store has none.
    render_anchor: RenderAnchor | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for name, kind in (("prompt_ids", TokenIds), ("output_ids", TokenIds), ("logprobs", Logprobs)):
            if not isinstance(getattr(self, name), kind):
                object.__setattr__(self, name, kind(getattr(self, name)))

    @property
    def held(self) -> int:
        """Token ids this turn stores itself: its output and the prompt ids it added (the reused
        prefix is its ancestors' storage)."""
        return self.prompt_ids.held + len(self.output_ids)


def prompt_after(parent: Turn | None, reused: int, added: Iterable[int]) -> TokenIds:
    """A turn's prompt ids: the first ``reused`` ids of ``parent``'s prompt and output, then
    ``added``, sharing the parent's storage (what makes a session's memory its tokens, not its
    turns times its context)."""
    if parent is None or not reused:
        return TokenIds(added)
    if reused > len(parent.prompt_ids) + len(parent.output_ids):
        raise ValueError(f"{reused} reused ids, but turn {parent.turn_id} holds fewer")
    return TokenIds(added, parent.prompt_ids.then(parent.output_ids).head(reused))


Chain = TokenChain
"""A root-to-leaf path of a session's tree (:func:`pipeline.chain_tokens`, the same the consumers build)."""


SessionKey = tuple[str, str]
"""A session's name: (tenant, session id)."""


@dataclass(slots=True)
class Session:
    """A tree of turns owned by one tenant (API key)."""

    session_id: str
    tenant: str
    created_at: float
    last_active: float
    turns: dict[str, Turn] = field(default_factory=dict)
    by_key: dict[bytes, list[str]] = field(default_factory=dict)
    closed: bool = False
    feedback: list[dict[str, Any]] = field(default_factory=list)
    by_tokens: dict[bytes, str] = field(default_factory=dict)  # digest of prompt + output ids -> turn id
    token_lengths: dict[int, int] = field(default_factory=dict)  # lengths of those sequences -> how many
    token_digests: dict[str, bytes] = field(default_factory=dict)  # turn id -> its digest
    # turn id -> the hasher that made its digest, for its continuations to extend (O(what they add))
    token_hashers: dict[str, Any] = field(default_factory=dict)
    announced: bool = False  # its session.opened was published (here, or by the replica that created it)
    # Durable event numbers: the next one, and the end of the block this replica holds (None:
    # unbounded, a session nobody else writes); reserved blocks not yet started; and the numbers
    # each turn's events took here (turn.started, then turn.completed/aborted).
    seq_next: int = 0
    seq_end: int | None = None
    seq_blocks: list[tuple[int, int]] = field(default_factory=list)
    turn_seqs: dict[str, list[int]] = field(default_factory=dict)
    opened_seq: int | None = None
    # The shared sessions' bookkeeping (revision, loaded events) when they are on: theirs to type
    # and read (sessions._shared.SharedState); the store below them only carries it.
    shared: object | None = None
    captured: bool = True  # False: its user did not consent; nothing of it leaves the process (docs/data-rights.md)
    # Token ids its turns hold in memory (each turn's prompt and output), and how many of them the
    # store holding it has counted towards its bound (SessionStore's max_tokens).
    held_tokens: int = 0
    counted_tokens: int = 0

    @property
    def key(self) -> SessionKey:
        """What names it: its tenant and its id (a session id is a name within its tenant)."""
        return (self.tenant, self.session_id)

    @property
    def scope(self) -> str:
        """What its conversations are found under: its tenant's captured sessions or uncaptured ones,
        never both (a capture-off request never continues a captured conversation, nor the reverse)."""
        return scope_of(self.tenant, self.captured)

    def take_turn_seq(self, turn_id: str) -> int:
        """The number of the next durable event, one of turn ``turn_id``'s (kept in ``turn_seqs``,
        which the shared state records so that another replica reads the turn's events back)."""
        seq = self.take_seq()
        self.turn_seqs.setdefault(turn_id, []).append(seq)
        return seq

    def take_seq(self) -> int:
        """The number of the session's next durable event."""
        seq = self.seq_next
        if self.seq_end is not None and seq >= self.seq_end:
            if self.seq_blocks:
                seq, self.seq_end = self.seq_blocks.pop(0)
            else:
                # No block reserved here: NATS was away (or a cluster between leaders) when this
                # replica took the session over, or for a whole block's worth of its events. Numbers
                # next to the last would meet another replica's, and the consumers would drop one
                # of the two as a duplicate (seen in a rolling restart of a cluster: a turn lost).
                # A block at random far above any reservation cannot (odds 2^-31 a block); the
                # numbers need not be dense: session.closed lists the ones that exist.
                seq = _UNRESERVED_FROM + secrets.randbelow(_UNRESERVED_BLOCKS) * SEQ_BLOCK
                self.seq_end = seq + SEQ_BLOCK
                log.warning("session %s: no event numbers reserved here (NATS away); numbering from a block "
                            "at random, %d", self.session_id, seq)  # fmt: skip
        self.seq_next = seq + 1
        return seq

    def seqs_low(self) -> bool:
        """Whether this replica should reserve another block of event numbers for the session."""
        return self.seq_end is not None and not self.seq_blocks and self.seq_end - self.seq_next < SEQ_BLOCK // 4

    def add(self, turn: Turn) -> bytes | None:
        """Record a finished (or aborted) turn; returns its token digest if it can be continued by ids."""
        if turn.turn_id not in self.turns:
            self.held_tokens += turn.held
        self.turns[turn.turn_id] = turn
        if turn.key is not None:
            self.by_key.setdefault(turn.key, []).append(turn.turn_id)
        if turn.finish_reason is None:
            return None
        hasher = self._token_hasher(turn)
        hasher.update(turn.output_ids.tobytes())
        digest: bytes = hasher.digest()
        self.token_hashers[turn.turn_id] = hasher
        length = len(turn.prompt_ids) + len(turn.output_ids)
        if digest not in self.by_tokens:
            self.token_lengths[length] = self.token_lengths.get(length, 0) + 1
        self.by_tokens[digest] = turn.turn_id
        self.token_digests[turn.turn_id] = digest
        return digest

    def _token_hasher(self, turn: Turn) -> Any:
        """A hasher fed ``turn``'s prompt ids: its parent's, extended by the ids after the ones it
        reused (the parent's prompt and output, verbatim), or a new one over them all."""
        start = 0
        hasher = hashlib.blake2b(digest_size=16)
        parent = self.turns.get(turn.parent_id) if turn.parent_id is not None else None
        reused = parent is not None and turn.reused_prompt_tokens == len(parent.prompt_ids) + len(parent.output_ids)
        if reused and turn.parent_id in self.token_hashers:
            hasher, start = self.token_hashers[turn.parent_id].copy(), turn.reused_prompt_tokens
        hasher.update(turn.prompt_ids.suffix(start).tobytes())
        return hasher

    def match_tokens(self, prompt_ids: list[int]) -> Turn | None:
        """The deepest finished turn whose prompt and output ids are a prefix of ``prompt_ids``."""
        for digest in prefix_digests(prompt_ids, self.token_lengths):
            turn_id = self.by_tokens.get(digest)
            if turn_id is not None and _extends(prompt_ids, self.turns[turn_id]):
                return self.turns[turn_id]
        return None

    def match(self, keys: list[bytes], positions: list[int]) -> tuple[Turn | None, int]:
        """The deepest turn whose conversation is a prefix of the request's, and its position.

        ``keys[i]`` is the prefix of i + 1 messages; ``positions`` are where the request has an
        assistant message before its last one (only there can a turn's key be). ``(None, -1)``: none.
        """
        for i in reversed(positions):
            ids = self.by_key.get(keys[i])
            if ids:
                return self.turns[ids[-1]], i  # the most recent of equal candidates (a retried turn)
        return None, -1

    def children(self) -> dict[str | None, list[Turn]]:
        """Turns by parent id (``None`` for roots), in creation order."""
        out: dict[str | None, list[Turn]] = {}
        for turn in self.turns.values():
            out.setdefault(turn.parent_id, []).append(turn)
        return out

    def chains(self) -> list[Chain]:
        """Every root-to-leaf path, with tokens, loss mask and logprobs aligned."""
        children = self.children()
        chains = []
        for leaf in self.turns.values():
            if children.get(leaf.turn_id):
                continue
            path = [leaf]
            while path[-1].parent_id is not None:
                path.append(self.turns[path[-1].parent_id])
            path.reverse()
            chains.append(chain_tokens(path))
        return chains


def prefix_digests(ids: list[int], lengths: dict[int, int] | Any) -> list[bytes]:
    """Digests of the prefixes of ``ids`` at the given ``lengths``, longest first (one pass over
    ``ids``; the bytes of :class:`TokenIds`, so that a turn's digest is taken over its storage)."""
    try:
        raw = array(TokenIds.typecode, ids).tobytes()
    except OverflowError:  # not token ids of any vocabulary: no turn holds them
        return []
    width = array(TokenIds.typecode).itemsize
    hasher = hashlib.blake2b(digest_size=16)
    done = 0
    out = []
    for length in sorted(n for n in lengths if 0 < n <= len(ids)):
        hasher.update(raw[done * width : length * width])
        done = length
        out.append(hasher.copy().digest())
    out.reverse()
    return out


def scope_of(tenant: str, captured: bool) -> str:
    """The key a tenant's captured (or uncaptured) sessions are indexed under."""
    return tenant if captured else f"{tenant}\x00uncaptured"


def _extends(prompt_ids: list[int], turn: Turn) -> bool:
    """Whether ``prompt_ids`` starts with the turn's prompt and output ids (digests could collide)."""
    size = len(turn.prompt_ids)
    end = size + len(turn.output_ids)
    return turn.prompt_ids == prompt_ids[:size] and turn.output_ids == prompt_ids[size:end]


class SessionStore:
    """In-memory sessions of all tenants, bounded by idle time, count and the token ids they hold.

    Automatic lookup goes through an index from (tenant, turn key) to session, so finding the
    session a conversation continues costs one dictionary probe per request message, however many
    sessions are open.
    """

    def __init__(
        self,
        *,
        max_sessions: int = 10_000,
        idle_seconds: float = 3600.0,
        max_tokens: int | None = None,
        on_close: Callable[[Session, str], None] | None = None,
        on_evict: Callable[[Session, str], None] | None = None,
    ) -> None:
        """``max_tokens``: beyond this many token ids held by all sessions' turns, the least
        recently used sessions are evicted too (never the one just used); ``None``: no bound."""
        # Keyed by (tenant, id): a session id is its tenant's name, and two tenants' `run-1` are two sessions.
        self._sessions: OrderedDict[SessionKey, Session] = OrderedDict()
        self._index: dict[tuple[str, bytes], SessionKey] = {}
        # Token-id prefixes (the token-in API): (tenant, digest) -> session, and each tenant's lengths.
        self._token_index: dict[tuple[str, bytes], SessionKey] = {}
        self._token_lengths: dict[str, dict[int, int]] = {}
        self._max_sessions = max_sessions
        self._max_tokens = max_tokens
        self.held_tokens = 0  # of the sessions held, as last counted (_count)
        self._idle_seconds = idle_seconds
        self._on_close = on_close
        self._on_evict = on_evict  # set: eviction only drops the cached copy (shared sessions)

    def get(self, session_id: str, tenant: str) -> Session:
        """The tenant's session ``session_id``; 404 if the tenant has none (another tenant's session
        of that name is not seen: it answers exactly as an id nobody used)."""
        session = self.lookup(session_id, tenant)
        if session is None:
            raise session_not_found(session_id)
        return session

    def lookup(self, session_id: str, tenant: str) -> Session | None:
        """The tenant's session ``session_id``, ``None`` if the tenant has none."""
        return self._sessions.get((tenant, session_id))

    def get_or_create(self, session_id: str, tenant: str, captured: bool = True) -> Session:
        """The tenant's named session, created on first use."""
        session = self.lookup(session_id, tenant)
        return session if session is not None else self._create(session_id, tenant, captured)

    def cached(self, session_id: str, tenant: str) -> Session | None:
        """The tenant's session ``session_id`` if this store holds it."""
        return self._sessions.get((tenant, session_id))

    def insert(self, session: Session) -> Session:
        """Hold ``session`` (loaded from shared state) and make its turns findable; returns the one held."""
        held = self._sessions.get(session.key)
        if held is not None:
            return held
        self._sessions[session.key] = session
        session.counted_tokens = 0
        self._count(session)
        for turn in session.turns.values():
            self._index_turn(session, turn)
        self._evict(time.time())
        return session

    def create(self, tenant: str, captured: bool = True) -> Session:
        """A new session with a generated id."""
        return self._create(f"sess{secrets.token_hex(12)}", tenant, captured)

    def find_at(self, scope: str, keys: list[bytes], positions: list[int]) -> tuple[Session, Turn, int] | None:
        """The session of ``scope`` (:func:`scope_of`) holding the deepest turn the conversation
        continues, with its position.

        One index probe per assistant position (see :meth:`Session.match`), however many sessions are open.
        """
        for i in reversed(positions):
            held = self._index.get((scope, keys[i]))
            session = self._sessions.get(held) if held is not None else None
            turn = session.match(keys, [i])[0] if session is not None else None
            if session is not None and turn is not None:
                return session, turn, i
        return None

    def discard(self, session: Session) -> None:
        """Forget ``session`` without closing it (a copy another replica's replaced)."""
        if self._sessions.get(session.key) is session:
            del self._sessions[session.key]
            self.held_tokens -= session.counted_tokens
            self._unindex(session)

    def find_tokens(self, scope: str, prompt_ids: list[int]) -> tuple[Session, Turn] | None:
        """The session of ``scope`` holding the deepest finished turn that ``prompt_ids`` extend."""
        lengths = self._token_lengths.get(scope)
        if not lengths:
            return None
        for digest in prefix_digests(prompt_ids, lengths):
            held = self._token_index.get((scope, digest))
            session = self._sessions.get(held) if held is not None else None
            turn = session.match_tokens(prompt_ids) if session is not None else None
            if session is not None and turn is not None:
                return session, turn
        return None

    def add_turn(self, session: Session, turn: Turn) -> None:
        """Record ``turn`` in ``session`` and make it findable (unless the session was closed)."""
        session.add(turn)
        if self._sessions.get(session.key) is session:
            self._count(session)
        self._index_turn(session, turn)

    def _index_turn(self, session: Session, turn: Turn) -> None:
        if self._sessions.get(session.key) is not session or session.closed:
            return
        digest = session.token_digests.get(turn.turn_id)
        if turn.key is not None:
            self._index[(session.scope, turn.key)] = session.key
        if digest is not None and (session.scope, digest) not in self._token_index:
            self._token_index[(session.scope, digest)] = session.key
            lengths = self._token_lengths.setdefault(session.scope, {})
            length = len(turn.prompt_ids) + len(turn.output_ids)
            lengths[length] = lengths.get(length, 0) + 1

    def close(self, session: Session, reason: str = "client") -> bool:
        """Close ``session``: no more turns, not found automatically. ``False`` if it already was."""
        if session.closed:
            return False
        session.closed = True
        self._unindex(session)
        if self._on_close is not None:
            self._on_close(session, reason)
        return True

    def mark_closed(self, session: Session) -> None:
        """Take note that ``session`` was closed elsewhere (another replica said so): nothing is published."""
        if not session.closed:
            session.closed = True
            self._unindex(session)

    def close_all(self, reason: str) -> None:
        """Close every open session (the gateway is shutting down)."""
        for session in list(self._sessions.values()):
            self.close(session, reason)

    def touch(self, session: Session) -> None:
        """Mark ``session`` as just used (it is evicted last), and evict what is due."""
        session.last_active = time.time()
        if self._sessions.get(session.key) is session:
            self._sessions.move_to_end(session.key)
            self._count(session)
        self._evict(session.last_active)

    def _count(self, session: Session) -> None:
        """Bring the store's count of held tokens up to ``session``'s (turns also arrive from the
        shared state, which counts here at the session's next use)."""
        self.held_tokens += session.held_tokens - session.counted_tokens
        session.counted_tokens = session.held_tokens

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._sessions.values()))

    def __len__(self) -> int:
        return len(self._sessions)

    def _create(self, session_id: str, tenant: str, captured: bool = True) -> Session:
        now = time.time()
        session = Session(session_id, tenant, now, now, captured=captured)
        self._sessions[session.key] = session
        self._evict(now)
        return session

    def _evict(self, now: float) -> None:
        while self._sessions:
            oldest = next(iter(self._sessions.values()))
            over_tokens = self._max_tokens is not None and self.held_tokens > self._max_tokens
            if (
                len(self._sessions) <= self._max_sessions
                and now - oldest.last_active < self._idle_seconds
                and not (over_tokens and len(self._sessions) > 1)
            ):
                return
            del self._sessions[oldest.key]
            self.held_tokens -= oldest.counted_tokens
            reason = "idle" if now - oldest.last_active >= self._idle_seconds else "evicted"
            if self._on_evict is not None:
                self._unindex(oldest)
                self._on_evict(oldest, reason)
                continue
            if not oldest.closed:
                oldest.closed = True
                if self._on_close is not None:
                    self._on_close(oldest, reason)
            self._unindex(oldest)

    def _unindex(self, session: Session) -> None:
        for key in session.by_key:
            if self._index.get((session.scope, key)) == session.key:
                del self._index[(session.scope, key)]
        lengths = self._token_lengths.get(session.scope, {})
        for digest, turn_id in session.by_tokens.items():
            if self._token_index.get((session.scope, digest)) != session.key:
                continue
            del self._token_index[(session.scope, digest)]
            turn = session.turns[turn_id]
            length = len(turn.prompt_ids) + len(turn.output_ids)
            lengths[length] -= 1
            if not lengths[length]:
                del lengths[length]
        if not lengths:
            self._token_lengths.pop(session.scope, None)


def session_not_found(session_id: str) -> NotFound:
    """No session of that name for this tenant, whether or not another tenant has one: the answer
    is the same either way (it must not tell one tenant which names another uses), and it says how
    sessions are scoped, for the honest case (an agent with ``api_key="anything"`` and a curl with no
    key are two tenants)."""
    return NotFound(
        f"No session `{session_id}` for this API key; sessions belong to the key that created them "
        "(without --api-key-file each bearer key is a tenant of its own, and a request without a key is "
        "`anonymous`).",
        param="session_id",
        code="session_not_found",
    )


def turn_routes(session: Session, turn: Turn) -> np.ndarray | None:
    """The experts that routed every position ``turn`` ran over (``prompt + output - 1`` rows):
    each row from the turn that first ran it, the ancestors' then its own. ``None`` when no turn of
    the chain recorded any (a dense model), or when the rows do not make the chain's
    (:func:`pipeline.routes.chain_routes_rows`: a turn of a replica that did not receive them,
    rows that do not line up), which is logged."""
    lineage = []
    current: Turn | None = turn
    while current is not None:
        lineage.append(current)
        current = session.turns.get(current.parent_id) if current.parent_id is not None else None
    try:
        return chain_routes_rows(
            [(t.turn_id, t.routes_start, t.routes) for t in reversed(lineage)],
            len(turn.prompt_ids) + len(turn.output_ids),
        )
    except ValueError as exc:  # the same rule the assembler applies; here the API answers null
        log.warning("turn %s: no routes for its chain: %s", turn.turn_id, exc)
        return None


def session_body(session: Session, *, routed_experts: bool = False) -> dict[str, Any]:
    """``GET /sessions/{id}``: the turn tree with token ids and logprobs, and its chains;
    ``routed_experts``: each turn's and chain's routes too (``stream_gateway.moe.encode_routes``)."""
    body = _session_body(session)
    if routed_experts:
        from stream_gateway.moe import encode_routes

        by_turn: dict[str, dict[str, Any] | None] = {}
        for view, turn in zip(body["turns"], session.turns.values(), strict=True):
            routes = turn_routes(session, turn)
            view["routed_experts"] = by_turn[turn.turn_id] = encode_routes(routes) if routes is not None else None
        for view in body["chains"]:  # a chain's routes are its leaf turn's
            view["routed_experts"] = by_turn[view["turn_ids"][-1]]
    return body


def _image_view(image: TurnImage) -> dict[str, Any]:
    return {name: getattr(image, name) for name in TurnImage.__dataclass_fields__}


def session_signals(session: Session) -> dict[str, list[str]]:
    """Every turn's implicit signals (:data:`SIGNAL_ORDER`): ``accepted`` when a later turn continues
    its conversation (a child, or a new root naming it), ``abandoned`` when its client left during
    the stream, and what later requests said about it (their turns' ``signals``)."""
    found: dict[str, set[str]] = {turn_id: set() for turn_id in session.turns}
    for turn in session.turns.values():
        if turn.abort_reason == "client_disconnected":
            found[turn.turn_id].add("abandoned")
        for earlier in (turn.parent_id, turn.predecessor_id, turn.continues_id):
            if earlier in found:
                found[earlier].add("accepted")
        for said in turn.signals:
            if said.turn_id in found:
                found[said.turn_id].add(said.signal)
    return {turn_id: [s for s in SIGNAL_ORDER if s in names] for turn_id, names in found.items()}


def _session_body(session: Session) -> dict[str, Any]:
    signals = session_signals(session)
    return {
        "session_id": session.session_id,
        "created_at": session.created_at,
        "last_active": session.last_active,
        "closed": session.closed,
        "feedback": session.feedback,
        "turns": [
            {
                "turn_id": t.turn_id,
                "parent_id": t.parent_id,
                "prompt_ids": t.prompt_ids.tolist(),
                "reused_prompt_tokens": t.reused_prompt_tokens,
                "output_ids": t.output_ids.tolist(),
                "logprobs": t.logprobs.tolist(),
                "finish_reason": t.finish_reason,
                "message": {
                    "role": "assistant",
                    "content": t.content,
                    "tool_calls": [
                        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                        for c in t.tool_calls
                    ],
                },
                "policy_version": t.policy_version,
                "policy_versions": t.policy_versions,
                "created_at": t.created_at,
                "time_to_first_token_s": t.time_to_first_token_s,
                "duration_s": t.duration_s,
                "matches_full_render": t.matches_full_render,
                "fallback_reason": t.fallback_reason,
                "predecessor_id": t.predecessor_id,
                "continues_id": t.continues_id,
                "cached_prompt_tokens": t.cached_prompt_tokens,
                "length_cause": t.length_cause,
                "reasoning_tokens": t.reasoning_tokens,
                "answer_start": t.answer_start,
                "adapter": t.adapter,
                "images": [_image_view(image) for image in t.images],
                "signals": signals[t.turn_id],
            }
            for t in session.turns.values()
        ],
        "chains": [
            {
                "turn_ids": c.turn_ids,
                "token_ids": c.token_ids,
                "mask": c.loss_mask,
                "logprobs": c.logprobs,
                "reasoning_mask": c.reasoning_mask,
            }
            for c in session.chains()
        ],
    }
