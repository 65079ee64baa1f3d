"""Capture: what the gateway does, as pipeline events.

:class:`EventRecorder` turns session and turn activity into :mod:`pipeline.events` models and
hands them to a publish function that never blocks (``EventPublisher.publish_nowait``). With
capture off (no ``--nats-url``) the recorder is disabled and every call returns at once; so is
every call about a session whose user did not consent (``Session.captured`` False: a tenant's
``capture=off``, a request's ``X-Capture: off``), and its images are never stored.

Deliberate choices:

* Events are built with ``model_construct``: the gateway's data is already valid, and
  validating a 100k-id prompt on the request path would cost more than the publish.
* Token deltas are coalesced per turn by :class:`DeltaCoalescer`: one ``turn.delta`` every
  ``delta_tokens`` tokens or, when a token arrives ``delta_interval_s`` after the last flush,
  then; the rest goes out when the turn ends. No timer task: a stalled stream has nothing to say.
  The defaults (128 tokens, 500 ms) bound a stream to 2 deltas a second at the pace of a served
  model (tens of tokens a second), and to one per 128 tokens beyond 256 tokens a second. Each delta
  costs the gateway tens of microseconds of CPU (an event, a publish, a socket write): at 50 ms,
  a stream at 50 tokens/s published one every 2.5 tokens, ~5% of the relay's CPU per token
  (``benchmarks/relay.py``); at 16 tokens a delta on the synthetic engine's 16k tokens/s it was
  1.2x the CPU per token of capture off (``benchmarks/capture_overhead.py``).
* ``seq`` numbers a session's durable events; it lives on the session, so concurrent requests
  of one session (n > 1, parallel sub-agents) still number their events without gaps. With shared
  sessions each replica numbers from its own reserved block (:meth:`Session.take_seq`), and the
  session records which numbers each turn took, so ``session.closed`` can list the numbers that
  exist (``expected_seqs``) wherever they were written.
* ``policy.applied`` / ``policy.rejected`` are this replica's answers to new weights, from a
  ``policy.updated`` event (:mod:`stream_gateway.control._policy_sync`) or ``POST /policy/weights``; ``policy.updated``
  itself is the trainer's (``pipeline.policies.publish_policy``).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import orjson
from pipeline.events import (
    SCHEMA_VERSION,
    Event,
    FeedbackRecorded,
    PolicyApplied,
    PolicyRejected,
    SamplingRecord,
    SessionClosed,
    SessionOpened,
    TurnDelta,
    TurnStarted,
    new_event_id,
    tenant_id,
)

from stream_gateway.sessions import turn_to_event

if TYPE_CHECKING:
    from pipeline.vision import ProcessedImage, VisionProcessor

    from stream_gateway.engines import SamplingParams, WeightUpdateReport
    from stream_gateway.sessions import Session, Turn

__all__ = ["DeltaCoalescer", "EventRecorder", "LiveSink"]


_STORED_KEPT = 65536  # image hashes remembered as stored (beyond, the publisher asks the bucket)


class DeltaCoalescer:
    """Cuts one turn's sampled tokens into few ``turn.delta`` events.

    It keeps no tokens of its own: the producer's lists of the turn's ids and logprobs are passed
    in, and all it costs per engine step is a length and a clock comparison. ``emit(offset, ids,
    logprobs)`` publishes one delta.
    """

    __slots__ = ("_due", "_emit", "_interval", "_offset", "_tokens")

    def __init__(self, emit: Callable[[int, list[int], list[float]], None], tokens: int, interval_s: float) -> None:
        self._emit = emit
        self._tokens, self._interval = tokens, interval_s
        self._offset = 0
        self._due = time.perf_counter() + interval_s

    def advance(self, ids: list[int], logprobs: list[float], now: float) -> None:
        """The turn now has ``ids``: emit a delta if enough tokens or time (``perf_counter``) have gathered."""
        if len(ids) - self._offset >= self._tokens or now >= self._due:
            self.flush(ids, logprobs, now)

    def flush(self, ids: list[int], logprobs: list[float], now: float | None = None) -> None:
        """Emit the tokens not yet in a delta, if any."""
        offset = self._offset
        if len(ids) > offset:
            self._emit(offset, ids[offset:], logprobs[offset:])
            self._offset = len(ids)
        self._due = (time.perf_counter() if now is None else now) + self._interval


class LiveSink(Protocol):
    """Where encoded live events go (``EventPublisher``): a subject per session, bytes per event."""

    def live_subject(self, tenant: str, session_id: str | None) -> str: ...

    def publish_live_nowait(self, subject: str, payload: bytes) -> None: ...


class EventRecorder:
    """Builds and publishes the gateway's events; a no-op when ``publish`` is ``None``."""

    def __init__(
        self,
        publish: Callable[[Event], None] | None,
        model: str,
        *,
        live_deltas: bool = True,
        delta_tokens: int = 128,
        delta_interval_s: float = 0.5,
        image_max_age_s: float = 0.0,
    ) -> None:
        self._publish = publish
        self._publish_durable: Callable[[Event], anyio.Event] | None = None
        self._store: Callable[[str, bytes], None] | None = None
        self._stored: OrderedDict[str, float] = OrderedDict()  # names queued for the object store, and when
        self._restore_after_s = image_max_age_s / 2 if image_max_age_s else 0.0
        self._model = model
        self._live_wanted = live_deltas
        self._live = live_deltas and publish is not None
        self._live_sink: LiveSink | None = None
        self._delta_tokens = delta_tokens
        self._delta_interval = delta_interval_s

    def attach(
        self,
        publish: Callable[[Event], None] | None,
        durable: Callable[[Event], anyio.Event] | None = None,
        store: Callable[[str, bytes], None] | None = None,
        live: LiveSink | None = None,
    ) -> None:
        """Start (or, with ``None``, stop) publishing: the publisher lives in the app's lifespan.

        ``durable`` publishes an event and returns what is set once it is durable
        (``EventPublisher.publish_durable``); without it, nothing waits for that. ``store`` queues
        an object (``EventPublisher.put_object_nowait``: images, before the turns that use them).
        ``live`` takes the live deltas already encoded (the publisher itself); without it they go
        to ``publish`` as events.
        """
        self._publish = publish
        self._publish_durable = durable if publish is not None else None
        self._store = store if publish is not None else None
        self._live_sink = live if publish is not None else None
        self._live = self._live_wanted and publish is not None

    def images_used(self, images: Sequence[ProcessedImage], processor: VisionProcessor | None) -> None:
        """Store the bytes of every image not stored yet (``images/<sha256>``) and the processor
        that made them (``processors/<fingerprint>``), before the events that refer to them."""
        store = self._store
        if store is None or processor is None:
            return
        stored = self._stored
        now = time.monotonic()
        # With an age limit on the bucket, an object in use is queued again once half of it has
        # passed: the publisher writes it again if the bucket's copy is that old (retention).
        fresh = now - self._restore_after_s if self._restore_after_s else -math.inf
        queued = stored.get(processor.fingerprint)
        if queued is None or queued < fresh:
            store(f"processors/{processor.fingerprint}", orjson.dumps(processor.record()))
            stored[processor.fingerprint] = now
        for image in images:
            queued = stored.get(image.sha256)
            if queued is not None and queued >= fresh:
                stored.move_to_end(image.sha256)
                continue
            store(f"images/{image.sha256}", image.data)
            stored[image.sha256] = now
            stored.move_to_end(image.sha256)
            if len(stored) > _STORED_KEPT:
                stored.popitem(last=False)  # forgotten here: the publisher still skips what the bucket has

    @property
    def enabled(self) -> bool:
        """Whether events go anywhere."""
        return self._publish is not None

    def session_opened(
        self, session: Session, policy_version: int, agent: str | None, metadata: dict[str, str]
    ) -> None:
        """A session's first request was admitted."""
        session.announced = True
        if self._publish is None or not session.captured:
            return
        seq = session.opened_seq = session.take_seq()
        self._publish(
            SessionOpened.model_construct(
                **self._common(session, policy_version, seq), agent=agent, metadata=dict(metadata)
            )
        )

    def session_closed(
        self,
        session: Session,
        policy_version: int,
        reason: str,
        expected_seqs: list[tuple[int, int]] | None = None,
    ) -> None:
        """No more turns will join ``session``; ``expected_seqs``: the numbers its events took (shared sessions)."""
        if self._publish is None or not session.captured:
            return
        self._publish(
            SessionClosed.model_construct(
                **self._common(session, policy_version, session.take_seq()),
                reason=reason,
                turns=len(session.turns),
                expected_seqs=expected_seqs,
            )
        )

    def turn_started(
        self,
        session: Session,
        turn_id: str,
        parent_turn_id: str | None,
        request_id: str,
        index: int,
        prompt_tokens: int,
        reused_prompt_tokens: int,
        params: SamplingParams,
        policy_version: int,
    ) -> None:
        """A generation was admitted to the engine."""
        if self._publish is None or not session.captured:
            return
        self._publish(
            TurnStarted.model_construct(
                **self._common(session, policy_version, session.take_turn_seq(turn_id)),
                turn_id=turn_id,
                parent_turn_id=parent_turn_id,
                request_id=request_id,
                choice_index=index,
                prompt_tokens=prompt_tokens,
                reused_prompt_tokens=reused_prompt_tokens,
                sampling=_sampling(params),
            )
        )

    def deltas(self, session: Session, turn_id: str, policy_version: int) -> DeltaCoalescer | None:
        """A coalescer for one turn's live deltas, or ``None`` when they are off.

        With a live sink (the publisher) a delta is encoded straight from the turn's constant
        fields and its tokens: what ``encode_event`` of the same ``TurnDelta`` writes, without
        building the model (about 10 us a delta less; ``tests/pipeline/test_gateway_events.py``
        decodes one against the model)."""
        publish = self._publish
        if publish is None or not self._live or not session.captured:
            return None
        common = self._common(session, policy_version, 0)  # deltas are not durable: no place in the sequence
        sink = self._live_sink
        if sink is None:

            def emit_event(offset: int, ids: list[int], logprobs: list[float]) -> None:
                publish(
                    TurnDelta.model_construct(
                        **{**common, "event_id": new_event_id(), "time": time.time()},
                        turn_id=turn_id,
                        offset=offset,
                        token_ids=ids,
                        logprobs=logprobs,
                    )
                )

            return DeltaCoalescer(emit_event, self._delta_tokens, self._delta_interval)
        fields = {**common, "kind": "turn.delta", "turn_id": turn_id}
        subject = sink.live_subject(common["tenant"], session.session_id)
        send, dumps, clock = sink.publish_live_nowait, orjson.dumps, time.time

        def emit(offset: int, ids: list[int], logprobs: list[float]) -> None:
            delta = {**fields, "event_id": new_event_id(), "time": clock()}
            delta["offset"], delta["token_ids"], delta["logprobs"] = offset, ids, logprobs
            send(subject, dumps(delta))

        return DeltaCoalescer(emit, self._delta_tokens, self._delta_interval)

    def turn_finished(
        self,
        session: Session,
        turn: Turn,
        request_id: str,
        index: int,
        params: SamplingParams,
        abort_reason: str | None,
        abort_detail: str | None = None,
    ) -> anyio.Event | None:
        """``turn.completed`` for a finished turn, ``turn.aborted`` otherwise; what is set once it is
        durable (in JetStream or the publisher's disk outbox), when the publisher can tell."""
        if self._publish is None or not session.captured:
            return None
        event = turn_to_event(
            turn,
            self._common(session, turn.policy_version, session.take_turn_seq(turn.turn_id)),
            request_id=request_id,
            choice_index=index,
            sampling=_sampling(params),
            abort_reason=abort_reason,
            abort_detail=abort_detail,
        )
        if self._publish_durable is not None:
            return self._publish_durable(event)
        self._publish(event)
        return None

    def feedback(
        self,
        session: Session,
        policy_version: int,
        turn_id: str | None,
        score: float,
        label: str | None,
        comment: str | None,
        source: str,
        author: str | None = None,
    ) -> tuple[str, int | None]:
        """Record a reward; returns the event id (also when capture is off, for the response) and its seq."""
        publish = self._publish if session.captured else None
        seq = session.take_seq() if publish is not None else None
        event = FeedbackRecorded.model_construct(
            **self._common(session, policy_version, seq or 0),
            turn_id=turn_id,
            score=score,
            label=label,
            comment=comment,
            source=source,
            author=author,
        )
        if publish is not None:
            publish(event)
        return event.event_id, seq

    def policy_applied(self, report: WeightUpdateReport, *, replica: str, source: str, download_s: float,
                       apply_s: float, adapter: str | None = None) -> None:  # fmt: skip
        """This replica now samples from ``report.policy_version`` (of LoRA ``adapter``, if named)."""
        if self._publish is None:
            return
        self._publish(
            PolicyApplied.model_construct(
                **self._global(report.policy_version),
                replica=replica,
                previous_version=report.previous_version,
                source=source,
                tensors=report.tensors,
                download_s=download_s,
                apply_s=apply_s,
                pause_s=report.pause_s,
                copy_s=report.copy_s,
                in_flight=report.in_flight,
                adapter=adapter,
            )
        )

    def policy_rejected(self, current: int, rejected: int, reason: str, detail: str, *, replica: str,
                        adapter: str | None = None) -> None:  # fmt: skip
        """This replica refused version ``rejected`` (of LoRA ``adapter``, if named) and keeps serving ``current``."""
        if self._publish is None:
            return
        self._publish(
            PolicyRejected.model_construct(
                **self._global(current),
                replica=replica,
                rejected_version=rejected,
                reason=reason,
                detail=detail,
                adapter=adapter,
            )
        )

    def _global(self, policy_version: int) -> dict[str, Any]:
        """Fields of an event that belongs to no session."""
        return {
            "schema_version": SCHEMA_VERSION,
            "event_id": new_event_id(),
            "time": time.time(),
            "tenant": "_",
            "session_id": None,
            "seq": 0,
            "model": self._model,
            "policy_version": policy_version,
        }

    def _common(self, session: Session, policy_version: int, seq: int) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "event_id": new_event_id(),
            "time": time.time(),
            "tenant": tenant_id(session.tenant),
            "session_id": session.session_id,
            "seq": seq,
            "model": self._model,
            "policy_version": policy_version,
        }


def _sampling(params: SamplingParams) -> SamplingRecord:
    return SamplingRecord.model_construct(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        max_tokens=params.max_tokens,
        seed=params.seed,
        constraint=params.constraint.kind if params.constraint is not None else None,
        grammar=params.constraint.grammar if params.constraint is not None else None,
    )
