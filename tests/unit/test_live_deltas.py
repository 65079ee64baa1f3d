"""Live deltas encoded straight to bytes are the ``turn.delta`` events the model would encode."""

from __future__ import annotations

import time

from pipeline.events import TurnDelta, decode_event, encode_event
from pipeline.streams import delta_subject
from stream_gateway.capture._recorder import EventRecorder
from stream_gateway.sessions._store import Session


class _Sink:
    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []

    def live_subject(self, tenant: str, session_id: str | None) -> str:
        from pipeline.streams import live_subject

        return live_subject("sg", tenant, session_id)

    def publish_live_nowait(self, subject: str, payload: bytes) -> None:
        self.sent.append((subject, payload))


def test_a_delta_encoded_from_the_turns_fields_is_the_models_event() -> None:
    events: list[object] = []
    session = Session("sess.one", "sk-key", time.time(), time.time())
    ids, logprobs = [5, 6, 7, 8], [-0.5, -1.25, -9999.0, 0.0]

    as_events = EventRecorder(events.append, "tiny", delta_tokens=2)
    coalescer = as_events.deltas(session, "turn-1", 3)
    assert coalescer is not None
    coalescer.advance(ids[:2], logprobs[:2], time.perf_counter())
    coalescer.advance(ids, logprobs, time.perf_counter())  # the second delta: offset 2, two tokens
    model = events[-1]
    assert isinstance(model, TurnDelta)

    sink = _Sink()
    as_bytes = EventRecorder(events.append, "tiny", delta_tokens=2)
    as_bytes.attach(events.append, live=sink)
    coalescer = as_bytes.deltas(session, "turn-1", 3)
    assert coalescer is not None
    coalescer.advance(ids[:2], logprobs[:2], time.perf_counter())
    coalescer.advance(ids, logprobs, time.perf_counter())
    subject, payload = sink.sent[-1]
    decoded = decode_event(payload)
    assert isinstance(decoded, TurnDelta)
    assert subject == delta_subject("sg", model)
    assert (decoded.offset, decoded.token_ids, decoded.logprobs) == (2, [7, 8], [-9999.0, 0.0])
    same = decode_event(encode_event(model)).model_dump(exclude={"event_id", "time"})
    assert decoded.model_dump(exclude={"event_id", "time"}) == same
    assert decoded.event_id != model.event_id and abs(decoded.time - model.time) < 60
    assert len(events) == 2  # with the sink, nothing went through ``publish`` as an event
