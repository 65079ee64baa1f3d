"""The reward worker and the batcher's rewards from its scores, against a real nats-server.

Trajectories are synthetic (:func:`tests.support.trajectories.make_trajectory`), published as the
assembler publishes them. The scorers are real: Python functions and a verifier run as a command
(:mod:`tests.support.scorers`), and a judge served by a second gateway process on the scripted
engine (the untrained tiny model saying what its script says: nothing about a model's judgement
is tested, only the path of its answer). The replica test runs ``stream-gateway reward`` as two
processes and kills one.
"""

from __future__ import annotations

import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import httpx
import orjson
import pytest
from nats.js import JetStreamContext

from consumers.batcher import Batcher
from consumers.parquet import decode_batch
from consumers.reward_worker import RewardWorker, RewardWorkerConfig
from consumers.scorers import parse_scorer
from consumers.scores import ScoreRecord, score_key
from consumers.streams import ConsumerStreams
from consumers.trajectory import Trajectory
from pipeline.embedded import EmbeddedNatsServer
from pipeline.kv import current_entries

from ..support.scorers import length, verified
from ..support.servers import free_port, wait_healthy
from ..support.trajectories import make_trajectory
from .test_batcher import batcher_config, jetstream, publish, read_manifests, read_object, unique_names, wait_until

pytestmark = pytest.mark.anyio

REPO = Path(__file__).resolve().parents[2]
VERIFIER = f"{sys.executable} {REPO / 'tests' / 'support' / 'scorers.py'}"


def scored_names() -> ConsumerStreams:
    """Streams and buckets of this test's own, the scores' bucket too."""
    names = unique_names()
    return replace(names, score_bucket=f"sc_{names.prefix}")


def unrewarded(rng: random.Random, **options: Any) -> Trajectory:
    """A trajectory as the assembler emits one under ``up``: the default reward, no feedback."""
    return make_trajectory(rng, **options).rewarded(0.0, "default")


def worker_config(url: str, names: ConsumerStreams, *scorers: str, **options: Any) -> RewardWorkerConfig:
    specs = tuple(replace(parse_scorer(text), timeout_s=10.0) for text in scorers)
    return RewardWorkerConfig(servers=(url,), names=names, scorers=specs, ack_wait_s=5.0, **options)


async def records(js: JetStreamContext, names: ConsumerStreams) -> dict[str, ScoreRecord]:
    """Every record in the scores' bucket, by key."""
    kv = await js.key_value(names.score_bucket)
    return {key: ScoreRecord.decode(entry.value or b"") for key, entry in (await current_entries(kv)).items()}


@asynccontextmanager
async def running(*services: Any) -> AsyncIterator[None]:
    """Each of ``services`` (``run(task_status=...)``) started in a task group, cancelled on exit."""
    async with anyio.create_task_group() as tg:
        for service in services:
            await tg.start(service.run)
        yield
        tg.cancel_scope.cancel()


async def batched(js: JetStreamContext, names: ConsumerStreams) -> list[Trajectory]:
    """The rows of every batch published so far, in order."""
    rows: list[Trajectory] = []
    for _, manifest in await read_manifests(js, names):
        rows += decode_batch(await read_object(js, manifest))[0]
    return rows


# -- replicas ------------------------------------------------------------------------------------


def _reward_process(url: str, log: Path, metrics_port: int) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "consumers.cli", "reward", "--nats-url", url, "--ack-wait", "2",
               "--scorer", "fn=python:tests.support.scorers:slow_length", "--scorer", f"tests=command:{VERIFIER}",
               "--scorer-concurrency", "2", "--max-in-flight", "4", "--metrics-port", str(metrics_port)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAM_GATEWAY_")}
    with log.open("w") as out:
        return subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env, text=True)


async def test_two_replicas_one_killed_score_every_trajectory_once_per_scorer(tmp_path: Path) -> None:
    """Two ``stream-gateway reward`` processes share the work; one is killed (SIGKILL) mid-way. Every
    trajectory ends with exactly one record per scorer (each key written once: the bucket's last
    sequence is the number of keys), holding the scorer's own verdict, and nothing is left unacknowledged."""
    rng = random.Random(57)
    trajectories = [make_trajectory(rng, response_len=rng.randrange(4, 20)) for _ in range(40)]
    names = ConsumerStreams()  # the command's defaults, on a server of this test's own
    with EmbeddedNatsServer() as server, anyio.fail_after(90):
        ports = [free_port(), free_port()]
        workers = [_reward_process(server.url, tmp_path / f"w{i}.log", ports[i]) for i in range(2)]
        try:
            async with jetstream(server.url, names) as (nc, js):
                await publish(nc, js, names, *trajectories)
                await wait_until(lambda: _recorded_by(js, names, workers[0].pid, 6))  # under way
                workers[0].send_signal(signal.SIGKILL)
                workers[0].wait(timeout=10)
                await wait_until(lambda: _count(js, names, 2 * len(trajectories)))
                found = await records(js, names)
                info = await js.stream_info(f"KV_{names.score_bucket}")
                consumer = await js.consumer_info(names.trajectories, "rewarder")
                await wait_until(lambda: _settled(js, names))
            async with httpx.AsyncClient(timeout=5) as client:
                metrics = (await client.get(f"http://127.0.0.1:{ports[1]}/metrics")).text
            # Ctrl-C stops the survivor at once, whatever it was waiting on (the event loop reads the
            # signal: a KeyboardInterrupt inside nats-py once left a worker running for minutes).
            workers[1].send_signal(signal.SIGINT)
            assert workers[1].wait(timeout=20) == 0
            assert "reward: SIGINT, stopping" in (tmp_path / "w1.log").read_text()
        finally:
            for worker in workers:
                if worker.poll() is None:
                    worker.kill()
                    worker.wait(timeout=10)
    assert info.state.last_seq == len(found) == 2 * len(trajectories)  # each key written once
    for t in trajectories:
        fn = found[score_key(t.tenant, t.session_id, t.trajectory_id, "fn")]
        tests = found[score_key(t.tenant, t.session_id, t.trajectory_id, "tests")]
        expected = length(t.model_dump())
        assert (fn.status, fn.score, fn.parts) == ("scored", expected["score"], {"long": expected["long"]})
        assert fn.turns == {turn.turn_id: turn.length / 10 for turn in t.turns}
        assert (tests.status, tests.score) == ("scored", verified(t.model_dump()))
        assert tests.parts == {"checked": float(len(t.token_ids))}
    by_worker = {r.worker for r in found.values()}
    assert len(by_worker) == 2, by_worker  # the killed replica had recorded some, the other the rest
    assert consumer.config.ack_wait == 2.0
    # The survivor's /metrics counts what it recorded.
    survivor = f":{workers[1].pid}"
    for scorer in ("fn", "tests"):
        mine = sum(r.worker.endswith(survivor) for r in found.values() if r.scorer == scorer)
        assert f'sg_reward_scores_total{{scorer="{scorer}",outcome="scored"}} {mine}' in metrics, metrics
        assert f'sg_reward_scores_total{{scorer="{scorer}",outcome="error"}} 0' in metrics, metrics


async def _count(js: JetStreamContext, names: ConsumerStreams, at_least: int) -> bool:
    from nats.js.errors import NotFoundError

    try:
        info = await js.stream_info(f"KV_{names.score_bucket}")
    except NotFoundError:  # the bucket not there yet
        return False
    return info.state.messages >= at_least


async def _recorded_by(js: JetStreamContext, names: ConsumerStreams, pid: int, at_least: int) -> bool:
    from nats.js.errors import BucketNotFoundError

    try:
        found = await records(js, names)
    except BucketNotFoundError:  # the bucket not there yet
        return False
    return sum(r.worker.endswith(f":{pid}") for r in found.values()) >= at_least


async def _settled(js: JetStreamContext, names: ConsumerStreams) -> bool:
    consumer = await js.consumer_info(names.trajectories, "rewarder")
    return consumer.num_pending == 0 and consumer.num_ack_pending == 0


# -- the batcher's reward ------------------------------------------------------------------------


async def test_a_python_scorer_and_a_command_verifier_make_the_reward_the_batcher_is_told(
    nats_server: EmbeddedNatsServer,
) -> None:
    """``--reward 0.5*fn+0.5*tests``, both awaited: each row's reward is the formula over its two
    scores and ``reward_source`` names it; a user's feedback wins; nothing is flagged unscored."""
    rng = random.Random(1)
    names = scored_names()
    plain = [unrewarded(rng, group=None) for _ in range(3)]
    rated = make_trajectory(rng, group=None)  # session feedback: reward 1.0, reward_source "feedback"
    worker = RewardWorker(worker_config(
        nats_server.url, names, "fn=python:tests.support.scorers:async_length", f"tests=command:{VERIFIER}"
    ))  # fmt: skip
    batcher = Batcher(batcher_config(nats_server.url, names, batch_size=4, reward="0.5*fn+0.5*tests",
                                     await_scorers=(("fn", 30.0), ("tests", 30.0))))  # fmt: skip
    with anyio.fail_after(60):
        async with jetstream(nats_server.url, names) as (nc, js), running(batcher, worker):
            await publish(nc, js, names, *plain, rated)
            await wait_until(lambda: batcher.statistics().batches == 1)
            rows = {t.trajectory_id: t for t in await batched(js, names)}
    for t in plain:
        row, document = rows[t.trajectory_id], t.model_dump()
        assert row.reward == pytest.approx(0.5 * length(document)["score"] + 0.5 * verified(document))
        assert row.reward_source == "0.5*fn+0.5*tests" and "unscored" not in row.health
        assert all(turn.reward is None for turn in row.turns)  # tests gives no per-turn scores: no turn's formula
    assert (rows[rated.trajectory_id].reward, rows[rated.trajectory_id].reward_source) == (1.0, "feedback")
    s = worker.statistics()
    assert (s.scorers["fn"].scored, s.scorers["tests"].scored, s.trajectories) == (4, 4, 4)
    assert (batcher.statistics().awaiting_scores, batcher.statistics().score_waits_expired) == (0, 0)


async def test_scores_that_come_later_revise_held_trajectories_and_are_late_rewards_after_their_batch(
    nats_server: EmbeddedNatsServer,
) -> None:
    """``--reward fn`` without waiting: a trajectory comes in unscored (the default reward, flagged);
    its score, when it comes, revises it while it is held (per-turn scores on its turns), and is
    recorded on its batch as a late reward once it is in one."""
    rng = random.Random(2)
    names = scored_names()
    first, second = unrewarded(rng, group=None), unrewarded(rng, group=None)
    config = batcher_config(nats_server.url, names, batch_size=2, reward="fn")
    batcher = Batcher(config)
    with anyio.fail_after(30):
        async with jetstream(nats_server.url, names) as (nc, js), running(batcher):
            kv = await js.key_value(names.score_bucket)
            await publish(nc, js, names, first)
            await wait_until(lambda: batcher.statistics().held == 1)
            await kv.create(_key(first), _record(first, 0.25).encode())
            await wait_until(lambda: batcher.statistics().revised == 1)
            await publish(nc, js, names, second)
            await wait_until(lambda: batcher.statistics().batches == 1)
            rows = {t.trajectory_id: t for t in await batched(js, names)}
            await kv.create(_key(second), _record(second, 0.75).encode())
            await wait_until(lambda: batcher.statistics().late_rewards == 1)
            [batch_id] = [manifest.batch_id for _, manifest in await read_manifests(js, names)]
            state = await js.key_value(config.state_bucket)
            late = orjson.loads((await state.get(f"l.{batch_id}.{second.trajectory_id}")).value or b"")
    row = rows[first.trajectory_id]
    assert (row.reward, row.reward_source, "unscored" in row.health) == (0.25, "fn", False)
    assert [turn.reward for turn in row.turns] == [0.5 for _ in first.turns]
    row = rows[second.trajectory_id]
    assert (row.reward, row.reward_source, "unscored" in row.health) == (0.0, "default", True)
    assert (late["reward"], late["reward_source"]) == (0.75, "fn")
    assert late["turn_rewards"] == {turn.turn_id: 0.5 for turn in second.turns}


def _key(t: Trajectory, scorer: str = "fn") -> str:
    return score_key(t.tenant, t.session_id, t.trajectory_id, scorer)


def _record(t: Trajectory, score: float, scorer: str = "fn") -> ScoreRecord:
    return ScoreRecord(
        trajectory_id=t.trajectory_id, session_id=t.session_id, tenant=t.tenant, scorer=scorer, kind="python",
        status="scored", score=score, turns={turn.turn_id: 0.5 for turn in t.turns}, attempts=1, duration_s=0.0,
        worker="test", at=time.time(),
    )  # fmt: skip


async def test_forgetting_a_session_purges_its_scores_and_its_trajectories_go_unscored(
    nats_server: EmbeddedNatsServer,
) -> None:
    """``stream-gateway forget`` purges a session's scores (a judge's answer quotes it) and counts them
    on its receipt; the worker acknowledges a late copy of its trajectory without scoring it."""
    from pipeline.events import subject_token
    from stream_stack.erasure import ErasureTarget, forget

    rng = random.Random(secrets.token_hex(8))  # a tombstone is for the whole server: a session no other test has
    names = scored_names()
    gone, kept = unrewarded(rng), unrewarded(rng)
    with anyio.fail_after(30):
        async with jetstream(nats_server.url, names) as (nc, js):
            kv = await js.key_value(names.score_bucket)
            for t in (gone, kept):
                await kv.create(_key(t), _record(t, 0.5).encode())
            target = ErasureTarget(subject_token(gone.tenant), gone.session_id, names=names, grace_s=0.0)
            receipt = await forget(nc, target)
            left = await records(js, names)
            worker = RewardWorker(worker_config(nats_server.url, names, "fn=python:tests.support.scorers:length"))
            async with running(worker):
                await publish(nc, js, names, gone)
                await wait_until(lambda: worker.statistics().erased == 1)
    assert receipt.scores == 1
    assert list(left) == [_key(kept)]
    assert worker.statistics().scorers["fn"].scored == 0


# -- judges --------------------------------------------------------------------------------------


@contextmanager
def judge_gateway(model: Path, workdir: Path, answer: str) -> Iterator[str]:
    """``stream-gateway serve`` on the scripted engine, saying ``answer`` to anything; its base URL."""
    script = workdir / "judge.json"
    script.write_text(orjson.dumps({"rules": [{"say": answer}]}).decode())
    port, log = free_port(), workdir / "judge.log"
    command = [sys.executable, "-m", "stream_gateway.cli", "serve", "--model", str(model), "--engine", "scripted",
               "--script", str(script), "--served-model-name", "judge", "--port", str(port),
               "--log-level", "warning"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAM_GATEWAY_")}
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, text=True)
    try:
        wait_healthy(process, port, log=log)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=30)


async def test_a_judge_served_by_a_second_gateway_scores_with_recording_off(
    nats_server: EmbeddedNatsServer, tiny_model_path: Path, tmp_path: Path
) -> None:
    """A judge is another gateway process (scripted: it answers ``{"score": 0.8}``): each row's reward
    is its score, its answer is kept beside the score, and the judge captured none of its calls."""
    rng = random.Random(3)
    names = scored_names()
    trajectories = [unrewarded(rng, group=None) for _ in range(2)]
    with judge_gateway(tiny_model_path, tmp_path, '{"score": 0.8}') as judge, anyio.fail_after(60):
        config = worker_config(nats_server.url, names, f"judge=judge:{judge}/v1#judge",
                               tokenizers={"": str(tiny_model_path)})  # fmt: skip
        worker = RewardWorker(config)
        batcher = Batcher(batcher_config(nats_server.url, names, batch_size=2, reward="judge",
                                         await_scorers=(("judge", 60.0),)))  # fmt: skip
        async with jetstream(nats_server.url, names) as (nc, js), running(batcher, worker):
            await publish(nc, js, names, *trajectories)
            await wait_until(lambda: batcher.statistics().batches == 1)
            rows = await batched(js, names)
            found = await records(js, names)
        async with httpx.AsyncClient() as client:
            metrics = (await client.get(f"{judge}/metrics")).text
    assert sorted((row.reward, row.reward_source) for row in rows) == [(0.8, "judge"), (0.8, "judge")]
    assert {(r.status, r.score, r.answer) for r in found.values()} == {("scored", 0.8, '{"score": 0.8}')}
    assert 'gateway_uncaptured_requests_total{reason="request"} 2.0' in metrics, metrics


async def test_a_judge_that_never_answers_times_out_and_the_batcher_goes_on_after_its_bound(
    nats_server: EmbeddedNatsServer, tiny_model_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A judge that accepts the connection and never answers: the batcher waits its bound
    (``--await-scorer judge:2``), saying in ``pending`` what it waits for, then batches the
    trajectories flagged ``unscored`` with the default reward; the worker records the timeouts."""
    rng = random.Random(4)
    names = scored_names()
    trajectories = [unrewarded(rng, group=None) for _ in range(2)]
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # connections complete in the backlog; nothing ever reads them
    judge = replace(parse_scorer(f"judge=judge:http://127.0.0.1:{silent.getsockname()[1]}/v1#judge"),
                    timeout_s=4.0, retries=0)  # fmt: skip
    worker = RewardWorker(RewardWorkerConfig(servers=(nats_server.url,), names=names, scorers=(judge,),
                                             tokenizers={"": str(tiny_model_path)}))  # fmt: skip
    batcher = Batcher(batcher_config(nats_server.url, names, batch_size=2, reward="judge",
                                     await_scorers=(("judge", 2.0),)))  # fmt: skip
    try:
        with anyio.fail_after(60):
            async with jetstream(nats_server.url, names) as (nc, js), running(batcher, worker):
                await publish(nc, js, names, *trajectories)
                await wait_until(lambda: batcher.statistics().awaiting_scores == 2)
                argv = ["pending", "--nats-url", nats_server.url, "--subject-prefix", names.prefix, "--timeout", "0.5"]
                assert await anyio.to_thread.run_sync(_consumers_main, argv) == 0
                await wait_until(lambda: batcher.statistics().batches == 1)
                rows = await batched(js, names)
                await wait_until(lambda: worker.statistics().scorers["judge"].timeout == 2)
                found = await records(js, names)
    finally:
        silent.close()
    said = capsys.readouterr().out
    assert "reward = judge; 2 trajectories waiting for scores (judge: 2; at most" in said, said
    assert all((row.reward, row.reward_source, "unscored" in row.health) == (0.0, "default", True) for row in rows)
    assert batcher.statistics().score_waits_expired == 2
    assert {(r.status, r.error, r.attempts) for r in found.values()} == {("timeout", "no answer within 4 s", 1)}
    assert 'sg_reward_scores_total{scorer="judge",outcome="timeout"} 2' in worker.metrics()


def _consumers_main(argv: list[str]) -> int:
    from consumers.cli import main

    return main(argv)


# -- up ------------------------------------------------------------------------------------------


def test_up_runs_the_reward_worker_when_given_a_scorer(tiny_model_path: Path, tmp_path: Path) -> None:
    """``up --scorer fn=python:...``: the banner names the scorer, the reward and its wait, and says
    what a trajectory without a score becomes; the batch's rows carry the scorer's reward (and its
    per-turn scores on their turns); the worker's ``/metrics`` counts them."""
    from openai import OpenAI

    from consumers.parquet import decode_batch as decode

    port, metrics = free_port(), free_port()
    data_dir = tmp_path / "up"
    command = [sys.executable, "-m", "stream_stack", "up", "--model", str(tiny_model_path), "--served-model-name",
               "tiny", "--port", str(port), "--data-dir", str(data_dir), "--nats-port", "0", "--nats-monitor-port",
               "0", "--console-port", "0", "--batch-size", "2", "--idle-timeout", "3",
               "--scorer", "fn=python:tests.support.scorers:length", "--reward-metrics-port", str(metrics)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAM_GATEWAY_")}
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    try:
        wait_healthy(process, port)
        for session in ("one", "two"):
            base = f"http://127.0.0.1:{port}/sessions/{session}"
            with OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60) as client:
                client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
            assert httpx.post(f"{base}/close", headers={"authorization": "Bearer x"}).is_success
        deadline = time.monotonic() + 60
        while not list((data_dir / "batches").glob("*.parquet")):
            assert time.monotonic() < deadline, "no batch was written"
            time.sleep(0.2)
        counters = httpx.get(f"http://127.0.0.1:{metrics}/metrics", timeout=5).text
    finally:
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=60)
    assert process.returncode == 0, output
    assert "rewards        reward worker: fn (python:tests.support.scorers:length); metrics " in output, output
    assert "reward = fn (a user's feedback wins); awaited: fn up to 60 s" in output, output
    assert "without feedback or every score: reward 0 (--default-reward: a placeholder" in output, output
    [batch] = list((data_dir / "batches").glob("*.parquet"))
    rows, _ = decode(batch.read_bytes())
    for row in rows:
        assert (row.reward, row.reward_source, row.health) == (len(row.token_ids) / 100, "fn", [])
        assert [turn.reward for turn in row.turns] == [turn.length / 10 for turn in row.turns]
    assert 'sg_reward_scores_total{scorer="fn",outcome="scored"} 2' in counters, counters
