"""Chaos: steady agent traffic while everything underneath fails, then an exact count.

Runs a real nats-server, a ``serve`` gateway (synthetic engine, shared sessions, disk outbox),
an ``assemble`` and a ``batch`` consumer, each its own process, and clients holding multi-turn
conversations (streamed, ``[DONE]`` = completed; each ends with ``POST /sessions/{id}/close``).
Meanwhile, at random moments, one fault at a time, each kind in turn:

* ``nats``: nats-server SIGKILLed, restarted 1-2 s later on the same store;
* ``gateway``: the gateway SIGKILLed, restarted at once (same outbox);
* ``assembler`` / ``batcher``: SIGKILLed, restarted 0.5 s later;
* ``storm``: for one second every new stream is dropped by its client after two chunks.

A turn whose stream failed is sent again, as an agent would. When the time is up, the clients
finish their conversations; the consumers get time to drain; then every turn a client completed
(its ``chatcmpl`` id) is looked up: its ``turn.completed`` event in the events stream, its turn in
a trajectory, that trajectory in a batch. Printed: the faults by kind, and

* lost: completed turns missing from the events / from every trajectory / trajectories in no
  batch (beyond the last, partly filled batch, which the batcher holds in its state);
* duplicated: events stored twice, trajectories emitted twice, trajectories in two batches.

Exit status 1 if anything was lost or duplicated.

    python benchmarks/chaos.py --duration 120 --conversations 8 --seed 1

With ``--cluster SCENARIO`` the stack runs on a three-node JetStream cluster instead
(:class:`~pipeline.embedded.EmbeddedNatsCluster`, everything replicated three times), with two
gateway replicas taking turns of every conversation in alternation (so every turn moves to the
other replica), and one kind of fault on NATS, over and over:

* ``node``: a random node SIGKILLed, restarted 2-4 s later on its store;
* ``rolling``: a rolling upgrade, every node restarted (SIGTERM) one at a time, each back and
  current before the next;
* ``leader``: the events stream's leader SIGKILLed, restarted 2-4 s later;
* ``partition``: a random node SIGSTOPped for 12 s (its peers elect new leaders), then continued.

Counted as above, and: the conversations whose turns all continued their chain (each turn's
parent the turn before, no ``fallback_reason``, the prefix reused), the longest a client waited
for one turn (from its first attempt to ``[DONE]``), and the largest gateway outbox seen
(``gateway_events_outbox``, sampled every 0.25 s).

    python benchmarks/chaos.py --cluster all --duration 60 --seed 1
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _procs import free_port  # noqa: E402

from consumers.parquet import BatchManifest  # noqa: E402
from consumers.streams import ConsumerStreams  # noqa: E402
from consumers.trajectory import Trajectory  # noqa: E402
from pipeline.connection import connect, split_servers  # noqa: E402
from pipeline.embedded import EmbeddedNatsCluster, EmbeddedNatsServer, NatsServerConfig  # noqa: E402
from pipeline.subscriber import decode_message, message_payload  # noqa: E402
from stream_gateway.models import resolve_model  # noqa: E402

FAULTS = ("nats", "gateway", "assembler", "batcher", "storm")
CLUSTER_FAULTS = ("node", "rolling", "leader", "partition")
PARTITION_S = 12.0  # longer than an election (nats-server's raft: 4-9 s without a leader's heartbeat)
BATCH_SIZE = 4


class Process:
    """A ``stream-gateway`` command in its own process; SIGKILL and start again."""

    def __init__(self, name: str, args: list[str], log: Path) -> None:
        self.name, self.args, self.log = name, args, log
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("STREAM_GATEWAY_")}
        with self.log.open("ab") as out:
            self.process = subprocess.Popen([sys.executable, "-m", "stream_stack", *self.args], stdout=out,
                                            stderr=subprocess.STDOUT, env=env, cwd=ROOT)  # fmt: skip

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


@dataclass
class Tally:
    completed: list[tuple[str, str]] = field(default_factory=list)  # (session, chatcmpl id) a client finished
    retried: int = 0  # turns sent again after a failed stream
    dropped_by_client: int = 0  # streams the storm cut
    conversations: int = 0
    closes: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    storm_until: float = 0.0
    longest_wait_s: float = 0.0  # one turn, from its first attempt to [DONE]
    outbox_high: int = 0  # the largest gateway outbox seen


async def _turn(client: httpx.AsyncClient, url: str, messages: list[dict[str, str]], tally: Tally) -> str | None:
    """One streamed turn: its text once ``[DONE]`` arrived, else ``None`` (failed or cut)."""
    body = {"model": "m", "messages": messages, "max_tokens": 12, "stream": True}
    storm = time.monotonic() < tally.storm_until
    text, completion_id, chunks = [], None, 0
    try:
        # Longer than the gateway's --session-handoff-seconds (30): a turn may wait that long on a cluster.
        async with client.stream("POST", url, json=body, timeout=httpx.Timeout(45, connect=2)) as response:
            if response.status_code != 200:
                return None
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    assert completion_id is not None
                    tally.completed.append((url.split("/")[4], completion_id))
                    return "".join(text)
                if not line.startswith("data: "):
                    continue
                chunk = orjson.loads(line[6:])
                completion_id = chunk["id"]
                for choice in chunk.get("choices", ()):
                    text.append(choice["delta"].get("content") or "")
                chunks += 1
                if storm and chunks >= 2:
                    tally.dropped_by_client += 1
                    return None  # leaving the block closes the connection mid-stream
    except (httpx.HTTPError, OSError):
        pass
    return None


async def _conversation(client: httpx.AsyncClient, bases: list[str], name: str, tally: Tally, turns: int) -> None:
    """``turns`` turns of conversation ``name``, turn ``i`` on ``bases[i % len(bases)]``, then its close."""
    messages = [{"role": "user", "content": f"{name}: hello"}]
    for index in range(turns):
        url = f"{bases[index % len(bases)]}/sessions/{name}/v1/chat/completions"
        asked = time.monotonic()
        while (text := await _turn(client, url, messages, tally)) is None:
            tally.retried += 1
            await asyncio.sleep(0.2)
        tally.longest_wait_s = max(tally.longest_wait_s, time.monotonic() - asked)
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"and {index}?"}]
    base = bases[turns % len(bases)]
    while True:  # closing is retried too: it is what lets the assembler emit the session now
        try:
            response = await client.post(f"{base}/sessions/{name}/close", timeout=10)
            if response.status_code in (200, 409):
                tally.closes += 1
                return
        except (httpx.HTTPError, OSError):
            pass
        await asyncio.sleep(0.3)


async def _clients(bases: list[str], args: argparse.Namespace, tally: Tally, stop: asyncio.Event) -> None:
    async def worker(index: int) -> None:
        async with httpx.AsyncClient() as client:
            number = 0
            while not stop.is_set():
                number += 1
                await _conversation(client, bases, f"chaos-{args.seed}-{index}-{number}", tally, args.turns)
                tally.conversations += 1

    await asyncio.gather(*(worker(i) for i in range(args.conversations)))


async def _wait_healthy(base: str, within_s: float = 60) -> None:
    deadline = time.monotonic() + within_s
    async with httpx.AsyncClient() as client:
        while time.monotonic() < deadline:
            try:
                if (await client.get(f"{base}/health", timeout=2)).status_code == 200:
                    return
            except (httpx.HTTPError, OSError):
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"the gateway at {base} did not become healthy")


async def _faults(
    rng: random.Random, args: argparse.Namespace, nats: EmbeddedNatsServer, procs: dict[str, Process],
    base: str, tally: Tally, stop: asyncio.Event,
) -> None:  # fmt: skip
    order: list[str] = []
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), rng.uniform(args.fault_every * 0.5, args.fault_every * 1.5))
            return
        except TimeoutError:
            pass
        if not order:
            order = list(FAULTS)
            rng.shuffle(order)
        kind = order.pop()
        tally.faults[kind] += 1
        print(f"  {time.strftime('%H:%M:%S')} fault: {kind}", flush=True)
        if kind == "nats":
            await asyncio.to_thread(nats.kill)
            await asyncio.sleep(rng.uniform(1, 2))
            await asyncio.to_thread(nats.restart)
        elif kind == "gateway":
            procs["gateway"].kill()
            procs["gateway"].start()
            await _wait_healthy(base)
        elif kind in ("assembler", "batcher"):
            procs[kind].kill()
            await asyncio.sleep(0.5)
            procs[kind].start()
        else:
            tally.storm_until = time.monotonic() + 1.0


async def _read(url: str, stream: str) -> list[object]:
    nc = await connect(split_servers(url), max_reconnect_attempts=5, reconnect_time_wait=0.5)
    try:
        js = nc.jetstream()
        info = await js.stream_info(stream)
        messages = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1) if info.state.messages else ():
            messages.append(await js.get_msg(stream, seq))
        out: list[object] = []
        for msg in messages:
            if stream == "SG_EVENTS":
                out.append(await decode_message(msg, js))  # type: ignore[arg-type]
            elif stream == "SG_TRAJECTORIES":
                out.append(Trajectory.decode(await message_payload(msg, js)))  # type: ignore[arg-type]
            else:
                out.append(BatchManifest.model_validate_json(msg.data))
        return out
    finally:
        await nc.close()


@dataclass
class Count:
    events_lost: int
    events_duplicated: int
    trajectories_lost: int
    trajectories_duplicated: int
    batch_lost: int
    batch_duplicated: int
    trajectories: int
    batches: int
    unbatched: int


def _extra(counts: Counter[Any]) -> int:
    """How many more times than once things were counted."""
    return sum(n - 1 for n in counts.values() if n > 1)


async def _count(url: str, tally: Tally) -> Count:
    names = ConsumerStreams()
    events = await _read(url, "SG_EVENTS")
    trajectories: list[Trajectory] = await _read(url, names.trajectories)  # type: ignore[assignment]
    manifests: list[BatchManifest] = await _read(url, names.batches)  # type: ignore[assignment]
    ids = Counter(getattr(e, "event_id", None) for e in events)
    turn_of: dict[str, list[str]] = defaultdict(list)  # chatcmpl id -> turn ids completed for it
    for event in events:
        if event.kind == "turn.completed":  # type: ignore[attr-defined]
            turn_of[event.request_id].append(event.turn_id)  # type: ignore[attr-defined]
    completed = [completion for _, completion in tally.completed]
    events_lost = sum(1 for c in completed if not turn_of.get(c))
    events_duplicated = _extra(ids) + sum(len(set(t)) - 1 for t in turn_of.values() if t)
    in_trajectories = {turn.turn_id for t in trajectories for turn in t.turns}
    trajectories_lost = sum(1 for c in completed if not set(turn_of.get(c, ())) & in_trajectories)
    seen = Counter(t.trajectory_id for t in trajectories)
    unique = {t.trajectory_id: t for t in trajectories}.values()
    shapes = Counter((t.session_id, tuple(turn.turn_id for turn in t.turns)) for t in unique)
    trajectories_duplicated = _extra(seen) + _extra(shapes)
    batched = Counter(tid for m in {m.batch_id: m for m in manifests}.values() for tid in m.trajectory_ids)
    batch_ids = Counter(m.batch_id for m in manifests)
    unbatched = sum(1 for tid in seen if tid not in batched)
    return Count(
        events_lost=events_lost,
        events_duplicated=events_duplicated,
        trajectories_lost=trajectories_lost,
        trajectories_duplicated=trajectories_duplicated,
        batch_lost=max(0, unbatched - (BATCH_SIZE - 1)),
        batch_duplicated=_extra(batched) + _extra(batch_ids),
        trajectories=len(seen),
        batches=len(batch_ids),
        unbatched=unbatched,
    )


async def run(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="chaos-"))
    model = str(resolve_model("tiny", None))
    nats = EmbeddedNatsServer(NatsServerConfig(store_dir=work / "nats", monitor_port=None))
    await asyncio.to_thread(nats.start)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    procs = {
        "gateway": Process("gateway", ["serve", "--engine", "synthetic", "--model", model, "--served-model-name", "m",
                                       "--port", str(port), "--nats-url", nats.url,
                                       "--outbox-dir", str(work / "outbox"), "--log-level", "warning",
                                       "--synthetic-tokens-per-second", str(args.tokens_per_second)],
                           work / "gateway.log"),
        "assembler": Process("assembler", ["assemble", "--nats-url", nats.url, "--close-grace", "2",
                                           "--idle-timeout", "60", "--default-reward", "1", "--ack-wait", "3"],
                             work / "assembler.log"),
        "batcher": Process("batcher", ["batch", "--nats-url", nats.url, "--batch-size", str(BATCH_SIZE),
                                       "--ack-wait", "3"], work / "batcher.log"),
    }  # fmt: skip
    for proc in procs.values():
        proc.start()
    tally = Tally()
    started = time.monotonic()
    try:
        await _wait_healthy(base)
        print(f"chaos: {args.duration:g} s, {args.conversations} conversations of {args.turns} turns, "
              f"a fault every ~{args.fault_every:g} s; logs in {work}", flush=True)  # fmt: skip
        stop = asyncio.Event()
        # Conversations in progress when the time is up finish (and close): 180 s at most.
        async with asyncio.timeout(args.duration + 180), asyncio.TaskGroup() as tasks:
            tasks.create_task(_clients([base], args, tally, stop))
            tasks.create_task(_faults(rng, args, nats, procs, base, tally, stop))
            await asyncio.sleep(args.duration)
            stop.set()
        traffic_s = time.monotonic() - started
        print(f"  traffic over after {traffic_s:.0f} s; {len(tally.completed)} turns completed; draining", flush=True)
        deadline = time.monotonic() + args.drain_timeout
        count = await _count(nats.url, tally)
        while time.monotonic() < deadline and (count.trajectories_lost or count.batch_lost or count.events_lost):
            await asyncio.sleep(2)
            count = await _count(nats.url, tally)
        drained_s = time.monotonic() - started - traffic_s
    finally:
        for proc in procs.values():
            proc.stop()
        await asyncio.to_thread(nats.stop)
    sessions = len({s for s, _ in tally.completed})
    rows = [
        ("duration (traffic / drain)", f"{traffic_s:.0f} s / {drained_s:.0f} s"),
        ("conversations closed / sessions", f"{tally.closes} / {sessions}"),
        ("turns completed by clients", f"{len(tally.completed)}"),
        ("turns sent again after a failure", f"{tally.retried} (of which {tally.dropped_by_client} cut by clients)"),
        ("faults", ", ".join(f"{k} {tally.faults[k]}" for k in FAULTS)),
        ("events lost / duplicated", f"{count.events_lost} / {count.events_duplicated}"),
        ("turns missing from trajectories / trajectories duplicated",
         f"{count.trajectories_lost} / {count.trajectories_duplicated}"),
        (f"trajectories / batches (of {BATCH_SIZE})", f"{count.trajectories} / {count.batches}"),
        ("trajectories in no batch (lost / still filling the last)",
         f"{count.batch_lost} / {count.unbatched - count.batch_lost}"),
        ("trajectories in two batches", f"{count.batch_duplicated}"),
    ]  # fmt: skip
    width = max(len(k) for k, _ in rows)
    print(f"| {'what'.ljust(width)} | result |\n|{'-' * (width + 2)}|---|")
    for key, value in rows:
        print(f"| {key.ljust(width)} | {value} |")
    bad = (count.events_lost + count.events_duplicated + count.trajectories_lost + count.trajectories_duplicated
           + count.batch_lost + count.batch_duplicated)  # fmt: skip
    return 1 if bad else 0


async def _cluster_faults(
    rng: random.Random, args: argparse.Namespace, scenario: str, cluster: EmbeddedNatsCluster,
    tally: Tally, stop: asyncio.Event,
) -> None:  # fmt: skip
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), rng.uniform(args.fault_every * 0.5, args.fault_every * 1.5))
            return
        except TimeoutError:
            pass
        tally.faults[scenario] += 1
        if scenario == "rolling":
            for node in range(len(cluster.servers)):
                print(f"  {time.strftime('%H:%M:%S')} rolling: node {node}", flush=True)
                await asyncio.to_thread(cluster.restart, node, 60)
            continue
        if scenario == "leader":
            leader = cluster.leader("SG_EVENTS")
            node = leader if leader is not None else rng.randrange(len(cluster.servers))
        else:
            node = rng.randrange(len(cluster.servers))
        print(f"  {time.strftime('%H:%M:%S')} {scenario}: node {node}", flush=True)
        if scenario == "partition":
            await asyncio.to_thread(cluster.pause, node)
            await asyncio.sleep(PARTITION_S)
            await asyncio.to_thread(cluster.resume, node)
        else:
            await asyncio.to_thread(cluster.kill, node)
            await asyncio.sleep(rng.uniform(2, 4))
            await asyncio.to_thread(cluster.restart, node, 60)
        await asyncio.to_thread(cluster.wait_healthy, 60)


async def _watch_outboxes(bases: list[str], tally: Tally, stop: asyncio.Event) -> None:
    async with httpx.AsyncClient() as client:
        while not stop.is_set():
            for base in bases:
                try:
                    text = (await client.get(f"{base}/metrics", timeout=2)).text
                except (httpx.HTTPError, OSError):
                    continue
                for line in text.splitlines():
                    if line.startswith("gateway_events_outbox "):
                        tally.outbox_high = max(tally.outbox_high, int(float(line.split()[1])))
            await asyncio.sleep(0.25)


async def _continued(bases: list[str], tally: Tally) -> tuple[int, int]:
    """(conversations whose finished turns form one chain with the prefix reused, conversations)."""
    sessions = sorted({s for s, _ in tally.completed})
    chained = 0
    async with httpx.AsyncClient() as client:
        for session in sessions:
            turns = (await client.get(f"{bases[0]}/sessions/{session}", timeout=30)).json()["turns"]
            done = sorted((t for t in turns if t["finish_reason"] is not None), key=lambda t: t["created_at"])
            links = itertools.pairwise(done)
            chained += all(
                b["parent_id"] == a["turn_id"] and b["fallback_reason"] is None and b["reused_prompt_tokens"] > 0
                for a, b in links
            )
    return chained, len(sessions)


async def run_cluster(args: argparse.Namespace, scenario: str) -> tuple[list[tuple[str, str]], int]:
    """One scenario on a three-node cluster: its table rows, and how many things were lost or duplicated."""
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix=f"chaos-{scenario}-"))
    model = str(resolve_model("tiny", None))
    cluster = EmbeddedNatsCluster(3, store_root=work / "nats")
    await asyncio.to_thread(cluster.start)
    url = cluster.url
    ports = [free_port(), free_port()]
    bases = [f"http://127.0.0.1:{port}" for port in ports]
    replicas = ["--stream-replicas", "3"]
    procs = {
        f"gateway-{i}": Process(f"gateway-{i}", [
            "serve", "--engine", "synthetic", "--model", model, "--served-model-name", "m", "--port", str(port),
            "--nats-url", url, *replicas, "--replica-id", f"g{i}", "--outbox-dir", str(work / f"outbox-{i}"),
            "--log-level", "warning", "--synthetic-tokens-per-second", str(args.tokens_per_second),
        ], work / f"gateway-{i}.log")
        for i, port in enumerate(ports)
    } | {
        "assembler": Process("assembler", ["assemble", "--nats-url", url, *replicas, "--close-grace", "15",
                                           "--idle-timeout", "60", "--default-reward", "1", "--ack-wait", "3"],
                             work / "assembler.log"),
        "batcher": Process("batcher", ["batch", "--nats-url", url, *replicas, "--batch-size", str(BATCH_SIZE),
                                       "--ack-wait", "3"], work / "batcher.log"),
    }  # fmt: skip
    for proc in procs.values():
        proc.start()
    tally = Tally()
    started = time.monotonic()
    try:
        for base in bases:
            await _wait_healthy(base)
        print(f"chaos on a 3-node cluster, {scenario}: {args.duration:g} s, {args.conversations} conversations "
              f"of {args.turns} turns over 2 replicas, a fault every ~{args.fault_every:g} s; logs in {work}",
              flush=True)  # fmt: skip
        stop = asyncio.Event()
        async with asyncio.timeout(args.duration + 600), asyncio.TaskGroup() as tasks:
            tasks.create_task(_clients(bases, args, tally, stop))
            tasks.create_task(_cluster_faults(rng, args, scenario, cluster, tally, stop))
            tasks.create_task(_watch_outboxes(bases, tally, stop))
            await asyncio.sleep(args.duration)
            stop.set()
        traffic_s = time.monotonic() - started
        await asyncio.to_thread(cluster.wait_healthy, 60)
        chained, conversations = await _continued(bases, tally)
        print(f"  traffic over after {traffic_s:.0f} s; {len(tally.completed)} turns completed; draining", flush=True)
        deadline = time.monotonic() + args.drain_timeout
        count = await _count(url, tally)
        while time.monotonic() < deadline and (count.trajectories_lost or count.batch_lost or count.events_lost):
            await asyncio.sleep(2)
            count = await _count(url, tally)
        events = len(await _read(url, "SG_EVENTS"))
    finally:
        for proc in procs.values():
            proc.stop()
        await asyncio.to_thread(cluster.stop)
    bad = (count.events_lost + count.events_duplicated + count.trajectories_lost + count.trajectories_duplicated
           + count.batch_lost + count.batch_duplicated)  # fmt: skip
    rows = [
        ("faults", f"{tally.faults[scenario]}"),
        ("turns completed", f"{len(tally.completed)} (sent again after a failure: {tally.retried})"),
        ("events stored", f"{events}"),
        ("trajectories / batches / batch rows",
         f"{count.trajectories} / {count.batches} / {count.trajectories - count.unbatched}"),
        ("lost (events / trajectories / batch rows)",
         f"{count.events_lost} / {count.trajectories_lost} / {count.batch_lost}"),
        ("duplicated (events / trajectories / batch rows)",
         f"{count.events_duplicated} / {count.trajectories_duplicated} / {count.batch_duplicated}"),
        ("conversations continued token-exactly", f"{chained} / {conversations}"),
        ("longest client wait for one turn", f"{tally.longest_wait_s:.1f} s"),
        ("outbox high-water mark (events)", f"{tally.outbox_high}"),
    ]  # fmt: skip
    return rows, bad


async def run_clusters(args: argparse.Namespace) -> int:
    scenarios = CLUSTER_FAULTS if args.cluster == "all" else (args.cluster,)
    results = {}
    for scenario in scenarios:
        results[scenario] = await run_cluster(args, scenario)
        print("\n".join(f"  {name}: {value}" for name, value in results[scenario][0]), flush=True)
    names = [name for name, _ in next(iter(results.values()))[0]]
    print(f"| what | {' | '.join(scenarios)} |\n|---|{'---|' * len(scenarios)}")
    for index, name in enumerate(names):
        print(f"| {name} | {' | '.join(results[s][0][index][1] for s in scenarios)} |")
    return 1 if any(bad for _, bad in results.values()) else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=120, help="seconds of traffic and faults (default 120)")
    parser.add_argument("--conversations", type=int, default=8, help="concurrent conversations (default 8)")
    parser.add_argument("--turns", type=int, default=3, help="turns per conversation (default 3)")
    parser.add_argument("--fault-every", type=float, default=10, help="mean seconds between faults (default 10)")
    parser.add_argument("--tokens-per-second", type=float, default=200, help="synthetic engine rate per stream")
    parser.add_argument("--drain-timeout", type=float, default=120, help="longest wait for the consumers at the end")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--cluster", choices=(*CLUSTER_FAULTS, "all"), help="run on a 3-node NATS cluster with this kind of fault"
    )
    args = parser.parse_args()
    return asyncio.run(run_clusters(args) if args.cluster else run(args))


if __name__ == "__main__":
    raise SystemExit(main())
