"""Reward worker throughput: trajectories scored per second per replica with a fast scorer, and its
scaling with 1, 2 and 4 replicas sharing one durable consumer.

Run (from the repository root)::

    .venv/bin/python benchmarks/reward_worker.py
    .venv/bin/python benchmarks/reward_worker.py --trajectories 4000 --replicas 1 2 4 --repeats 3 --json results.json
    .venv/bin/python benchmarks/reward_worker.py --scorer command   # a verifier run as a command instead

What is measured, for each replica count, on a fresh embedded nats-server (JetStream, temp file
store), so no record of an earlier run is found:

* the trajectories: ``--trajectories`` synthetic ones of ``--tokens`` ids in two turns (the JSON the
  assembler publishes, ~10 bytes an id), published beforehand on ``SG_TRAJECTORIES``;
* the replicas: ``stream-gateway reward`` processes (``python -m consumers.cli reward``), one scorer
  each: ``--scorer python`` (default) is :func:`fast_score`, an ``async`` function of the document
  returning a number at once, so the worker's own cost is what is measured (fetch, the lookup of an
  existing record, the document, the record's ``kv.create``, the ack); ``--scorer command`` runs
  ``python -c`` reading stdin per trajectory (a process start dominates);
* the rate: from the records' own timestamps (``at``, and ``worker``), over the window in which
  every replica was working: from the moment the last replica to start recorded its first score to
  the moment the first replica to finish recorded its last, the records in that window over its
  length. Start-up (imports, connecting: ~1 s a process) is outside it. Per replica: that rate over
  the replica count;
* the cost, which a busy machine does not blur: CPU milliseconds per trajectory scored, of the
  replicas together (from ``/proc``, start-up included: a few hundred ms a process) and of the
  nats-server.

With ``--repeats N`` the replica counts are run in turn N times (1, 2, 4, 1, 2, 4, ...) and the
median of each is reported, so a machine busy with something else for a while weighs on every
count alike.

Every process shares the machine's cores (nats-server, the replicas; these figures: 2 cores), so
scaling past the core count measures the machine, not the worker. Absolute numbers depend on the
machine; the scaling is the result.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import nats

from consumers.scores import ScoreRecord
from consumers.streams import ConsumerStreams, ensure_consumer_streams
from consumers.trajectory import Trajectory, TurnSummary, trajectory_id
from pipeline.durable import publish_durable
from pipeline.embedded import EmbeddedNatsServer, NatsServerConfig

ROOT = Path(__file__).resolve().parent.parent
NAMES = ConsumerStreams()
COMMAND_SCORER = f"{sys.executable} -c \"import sys, json; print(len(json.load(sys.stdin)['token_ids']) / 1000)\""


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` (as ``benchmarks/_procs.py``'s; here, so that the replicas,
    which import this module for :func:`fast_score`, need nothing beside it)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def fast_score(document: dict[str, Any]) -> float:
    """The fast scorer: a number from the document, at once."""
    return len(document["token_ids"]) / 1000


def trajectory(rng: random.Random, tokens: int) -> Trajectory:
    """A synthetic two-turn trajectory of ``tokens`` ids."""
    session = f"s{rng.getrandbits(48):012x}"
    prompt, first = tokens // 2, tokens // 4
    second = tokens - prompt - first - 8
    ids = [rng.randrange(1, 30000) for _ in range(tokens)]
    mask = [0] * prompt + [1] * first + [0] * 8 + [1] * second
    turns = [
        TurnSummary(turn_id=f"{session}-0", start=prompt, length=first, finish_reason="tool_calls", policy_version=0),
        TurnSummary(
            turn_id=f"{session}-1", start=prompt + first + 8, length=second, finish_reason="stop", policy_version=0
        ),
    ]
    return Trajectory(
        trajectory_id=trajectory_id(session, [t.turn_id for t in turns]), session_id=session, tenant="bench",
        model="bench", token_ids=ids, loss_mask=mask, logprobs=[-0.5 * m for m in mask], prompt_length=prompt,
        turns=turns, num_turns=2, min_policy_version=0, max_policy_version=0, reward=None,
        emitted_because="closed", started_at=0.0, ended_at=1.0,
    )  # fmt: skip


async def publish_all(url: str, trajectories: list[Trajectory]) -> None:
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        await ensure_consumer_streams(js, NAMES)
        for t in trajectories:
            await publish_durable(nc, js, NAMES.trajectory_subject(t), t.trajectory_id, t.encode(),
                                  bucket=NAMES.payload_bucket)  # fmt: skip
    finally:
        await nc.close()


async def scored(url: str) -> list[ScoreRecord]:
    nc = await nats.connect(url)
    try:
        kv = await nc.jetstream().key_value(NAMES.score_bucket)
        return [ScoreRecord.decode((await kv.get(key)).value or b"") for key in await kv.keys()]
    finally:
        await nc.close()


async def count(url: str) -> int:
    nc = await nats.connect(url)
    try:
        return int((await nc.jetstream().stream_info(f"KV_{NAMES.score_bucket}")).state.messages)
    finally:
        await nc.close()


def run(replicas: int, trajectories: list[Trajectory], scorer: str, in_flight: int) -> dict[str, Any]:
    """One replica count on a fresh server: the rate over the window every replica worked in."""
    spec = "fast=python:benchmarks.reward_worker:fast_score" if scorer == "python" else f"fast=command:{COMMAND_SCORER}"
    with tempfile.TemporaryDirectory() as store, EmbeddedNatsServer(NatsServerConfig(store_dir=Path(store))) as server:
        anyio.run(publish_all, server.url, trajectories)
        command = [sys.executable, "-m", "consumers.cli", "reward", "--nats-url", server.url, "--scorer", spec,
                   "--max-in-flight", str(in_flight), "--scorer-concurrency", str(in_flight)]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if not k.startswith("STREAM_GATEWAY_")}
        processes = [
            subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for _ in range(replicas)
        ]
        cpu_before = cpu_s(server.pid or 0)
        try:
            deadline = time.monotonic() + 600
            while anyio.run(count, server.url) < len(trajectories):
                if time.monotonic() > deadline or any(p.poll() is not None for p in processes):
                    raise RuntimeError("the replicas did not score every trajectory")
                time.sleep(0.2)
            records = anyio.run(scored, server.url)
            workers_cpu = sum(cpu_s(process.pid) for process in processes)
            server_cpu = cpu_s(server.pid or 0) - cpu_before
        finally:
            for process in processes:
                process.terminate()
                process.wait(timeout=30)
    by_worker: dict[str, list[float]] = {}
    for record in records:
        by_worker.setdefault(record.worker, []).append(record.at)
    start = max(min(times) for times in by_worker.values())
    end = min(max(times) for times in by_worker.values())
    inside = sum(start <= record.at <= end for record in records)
    rate = inside / (end - start) if end > start else float("nan")
    return {
        "replicas": replicas, "scorer": scorer, "trajectories": len(records), "window_s": round(end - start, 3),
        "scored_in_window": inside, "per_s": round(rate, 1), "per_s_per_replica": round(rate / replicas, 1),
        "per_replica": {worker: len(times) for worker, times in sorted(by_worker.items())},
        "worker_cpu_ms_per_trajectory": round(1000 * workers_cpu / len(records), 3),
        "server_cpu_ms_per_trajectory": round(1000 * server_cpu / len(records), 3),
        "all_scored": all(record.status == "scored" for record in records),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trajectories", type=int, default=3000)
    parser.add_argument("--tokens", type=int, default=600, help="ids per trajectory")
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--scorer", choices=("python", "command"), default="python")
    parser.add_argument("--in-flight", type=int, default=64, help="each replica's --max-in-flight")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each replica count, alternated (median)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    rng = random.Random(0)
    trajectories = [trajectory(rng, args.tokens) for _ in range(args.trajectories)]
    runs: dict[int, list[dict[str, Any]]] = {replicas: [] for replicas in args.replicas}
    print(f"{args.trajectories} trajectories of {args.tokens} ids, scorer {args.scorer}, {os.cpu_count()} CPUs, "
          f"median of {args.repeats}")  # fmt: skip
    for _ in range(args.repeats):
        for replicas in args.replicas:
            result = run(replicas, trajectories, args.scorer, args.in_flight)
            assert result["all_scored"] and result["trajectories"] == args.trajectories, result
            runs[replicas].append(result)
    print(f"{'replicas':>8} {'scored/s':>10} {'per replica':>12} {'scaling':>8} {'worker CPU ms':>14} "
          f"{'nats CPU ms':>12}  runs (scored/s)")  # fmt: skip
    first = statistics.median(r["per_s"] for r in runs[args.replicas[0]])
    for replicas, results in runs.items():
        rate = statistics.median(r["per_s"] for r in results)
        each = ", ".join(f"{r['per_s']:.0f}" for r in results)
        worker = statistics.median(r["worker_cpu_ms_per_trajectory"] for r in results)
        server = statistics.median(r["server_cpu_ms_per_trajectory"] for r in results)
        print(f"{replicas:>8} {rate:>10.1f} {rate / replicas:>12.1f} {rate / first:>7.2f}x {worker:>14.3f} "
              f"{server:>12.3f}  {each}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(runs, indent=2))


if __name__ == "__main__":
    main()
