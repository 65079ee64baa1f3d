"""How long ``stream-gateway forget`` takes on a large events stream (issue 31's timing).

Run (from the repository root, after ``bash scripts/install.sh``)::

    .venv/bin/python benchmarks/forget.py                       # 1M events, 10,000 sessions
    .venv/bin/python benchmarks/forget.py --events 100000       # a quicker look

Set-up: an embedded nats-server (a temp store), and an events stream filled with ``--events``
turn events (each ~600 bytes of JSON: 48 token ids and logprobs, as a short agent turn records)
spread over ``--sessions`` sessions of ``--tenants`` tenants, published as fast as a bare nats-py
loop allows. The target tenant has ``--tenant-sessions`` of those sessions. Then, timed, with the
erasure's own code (``stream_stack.erasure.forget``, grace periods 0: the command's ``--grace``
adds twice its value):

1. ``forget --session`` of one session of another tenant;
2. ``forget --tenant`` of the target tenant (every one of its sessions).

Each prints its receipt's counts, its seconds, and the events left in the stream (all but the
forgotten ones: checked). The fill rate and the stream's size are printed too.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import nats
import orjson

from pipeline.embedded import EmbeddedNatsServer
from pipeline.events import subject_token, tenant_id
from pipeline.streams import StreamSpec, ensure_stream
from stream_stack.erasure import ErasureTarget, forget, tenant_token


def _event(tenant: str, session: str, seq: int) -> bytes:
    return orjson.dumps({
        "schema_version": 5, "kind": "turn.completed", "event_id": f"ev-{session}-{seq}", "time": 1.75e9,
        "tenant": tenant_id(tenant), "session_id": session, "seq": seq, "model": "m", "policy_version": 0,
        "turn_id": f"{session}-t{seq}", "output_ids": list(range(48)), "logprobs": [-0.5] * 48,
    })  # fmt: skip


async def _fill(url: str, events: int, sessions: int, tenants: int, target_sessions: int) -> float:
    nc = await nats.connect(url)
    js = nc.jetstream()
    await ensure_stream(js, StreamSpec())
    per_session = max(1, events // sessions)
    started = time.monotonic()
    pending: list[asyncio.Future[object]] = []
    sent = 0
    for s in range(sessions):
        tenant = "target" if s < target_sessions else f"tenant{s % tenants}"
        session = f"sess{s}"
        subject = f"sg.events.{subject_token(tenant_id(tenant))}.{subject_token(session)}.turn.completed"
        for seq in range(per_session):
            pending.append(await js.publish_async(subject, _event(tenant, session, seq)))
            sent += 1
            if len(pending) >= 4000:
                await asyncio.gather(*pending)
                pending.clear()
        if s % max(1, sessions // 10) == 0:
            print(f"  filled {sent:,} events", flush=True)
    await asyncio.gather(*pending)
    await nc.close()
    return time.monotonic() - started


async def _stored(url: str) -> tuple[int, int]:
    nc = await nats.connect(url)
    try:
        info = await nc.jetstream().stream_info("SG_EVENTS")
        return info.state.messages, info.state.bytes
    finally:
        await nc.close()


async def _timed(url: str, target: ErasureTarget) -> tuple[float, dict[str, object]]:
    nc = await nats.connect(url)
    try:
        started = time.monotonic()
        receipt = await forget(nc, target)
        return time.monotonic() - started, receipt.to_json()
    finally:
        await nc.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--sessions", type=int, default=10_000)
    parser.add_argument("--tenants", type=int, default=20)
    parser.add_argument("--tenant-sessions", type=int, default=1_000)
    args = parser.parse_args()
    with EmbeddedNatsServer() as server:
        print(f"filling {args.events:,} events over {args.sessions:,} sessions ({args.tenant_sessions:,} of 'target')")
        seconds = await _fill(server.url, args.events, args.sessions, args.tenants, args.tenant_sessions)
        messages, size = await _stored(server.url)
        print(f"stream: {messages:,} events, {size / 2**20:.0f} MiB, filled in {seconds:.0f} s "
              f"({messages / seconds:,.0f} events/s)")  # fmt: skip
        one = args.tenant_sessions  # the first session of another tenant
        other = f"tenant{one % args.tenants}"
        for label, target in (
            (f"forget --session sess{one}", ErasureTarget(tenant_token(other), f"sess{one}", grace_s=0.0)),
            ("forget --tenant target", ErasureTarget(tenant_token("target"), None, grace_s=0.0)),
        ):
            before, _ = await _stored(server.url)
            took, receipt = await _timed(server.url, target)
            after, _ = await _stored(server.url)
            assert before - after == receipt["events"], (before, after, receipt["events"])
            print(f"{label}: {took:.2f} s; sessions {receipt['sessions']}, events {receipt['events']:,}, "
                  f"session records {receipt['session_records']}; stream {before:,} -> {after:,} events")  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())
