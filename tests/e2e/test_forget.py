"""Erasure (``stream-gateway forget``, docs/data-rights.md) with real processes: a gateway capturing
into a real nats-server with shared sessions, the assembler and the batcher (writing parquet files),
then a forget. A scan of every stream (events, trajectories, batches, every key-value bucket and
object store), the outbox directories and the parquet files finds no trace of the forgotten
session (its id, its token ids), while the other sessions are intact; a replica stopped during the
forget replays its outbox afterwards without bringing the session back.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from consumers.parquet import decode_batch
from pipeline.embedded import EmbeddedNatsServer
from pipeline.events import tenant_id
from stream_gateway import Settings
from stream_gateway.engines import build_engine

from ..support.servers import RunningGateway, free_port, run_gateway, wait_healthy
from ..support.traces import file_traces, ids_text, nats_traces

KEYS = "sk-alice alice\nsk-bob bob\nsk-carol carol\nsk-dave dave\n"


class Stack:
    def __init__(self, gateway: RunningGateway, nats: EmbeddedNatsServer, root: Path) -> None:
        self.gateway, self.nats, self.url, self.root = gateway, nats, nats.url, root
        self.batches = root / "batches"

    def turns(self, key: str, session_id: str, marker: str, turns: int = 2) -> dict[str, Any]:
        """A conversation of ``turns`` turns in a named session, closed; its ``GET /sessions`` body."""
        headers = {"authorization": f"Bearer {key}"}
        base = f"{self.gateway.base_url}/sessions/{session_id}"
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"hello {marker}"}]
        for _ in range(turns):
            body = {"model": "tiny", "messages": messages, "max_tokens": 3}
            reply = httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=60)
            assert reply.status_code == 200, reply.text
            messages += [reply.json()["choices"][0]["message"], {"role": "user", "content": "more"}]
        session = httpx.get(base, headers=headers, timeout=30).json()
        assert httpx.post(f"{base}/close", headers=headers, timeout=30).is_success
        return dict(session)

    def forget(self, *args: str) -> list[dict[str, Any]]:
        return forget(self.url, *args, "--batches-dir", str(self.batches))


def forget(url: str, *args: str) -> list[dict[str, Any]]:
    """``stream-gateway forget`` in a process of its own; its receipts."""
    command = [sys.executable, "-m", "stream_stack", "forget", "--nats-url", url, "--grace", "0.5", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr + done.stdout
    decoder, text, out = json.JSONDecoder(), done.stdout.strip(), []
    while text:
        receipt, end = decoder.raw_decode(text)
        out.append(receipt)
        text = text[end:].strip()
    return out


def needles(session: dict[str, Any]) -> list[bytes]:
    """Its id and its first prompt's token ids (which hold the conversation's marker)."""
    return [session["session_id"].encode(), ids_text(session["turns"][0]["prompt_ids"])]


def _consumer(name: str, url: str, *args: str, log: Path) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "stream_stack", name, "--nats-url", url, *args]
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAM_GATEWAY_")}
    with log.open("a") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, text=True)


@pytest.fixture(scope="module")
def stack(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("forget")
    (root / "keys.txt").write_text(KEYS)
    with EmbeddedNatsServer() as nats:
        settings = Settings(
            model=str(tiny_model_path),
            served_model_name="tiny",
            nats_url=nats.url,
            outbox_dir=root / "outbox",
            api_key_file=root / "keys.txt",
            admin_api_keys=("sk-admin",),
        )
        consumers = [
            _consumer("assemble", nats.url, "--close-grace", "0.5", "--default-reward", "0.5", log=root / "a.log"),
            _consumer(
                "batch", nats.url, "--batch-size", "3", "--output-dir", str(root / "batches"), log=root / "b.log"
            ),
        ]
        try:
            with run_gateway(build_engine(settings), settings) as running:
                yield Stack(running, nats, root)
        finally:
            for process in consumers:
                process.terminate()
                process.wait(timeout=30)


def _wait(condition: Any, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def _held_by_batcher(url: str) -> int:
    """Trajectories delivered to the batcher and not yet acknowledged: held for a batch."""
    import anyio
    import nats

    async def ask() -> int:
        nc = await nats.connect(url)
        try:
            info = await nc.jetstream().consumer_info("SG_TRAJECTORIES", "batcher")
            return int(info.num_ack_pending or 0)
        finally:
            await nc.close()

    return anyio.run(ask)


def _batch_rows(directory: Path) -> list[str]:
    return sorted(t.session_id for p in directory.glob("*.parquet") for t in decode_batch(p.read_bytes())[0])


def test_a_forgotten_session_leaves_no_trace_and_the_others_stay(stack: Stack) -> None:
    gone = stack.turns("sk-alice", "forget-a1", "zebra quartz")
    kept = stack.turns("sk-alice", "forget-a2", "violet anchor")
    other = stack.turns("sk-bob", "forget-b1", "copper lantern")
    _wait(lambda: _batch_rows(stack.batches) == ["forget-a1", "forget-a2", "forget-b1"], "no batch of the three")
    others = [*needles(kept), *needles(other)]
    before = [t for t in nats_traces(stack.url, others) if not t.startswith(("SG_BATCHES", "OBJ_sg_batches"))]
    assert any(t.startswith("SG_TRAJECTORIES") for t in nats_traces(stack.url, needles(gone)))
    assert any(t.startswith("OBJ_sg_batches") for t in nats_traces(stack.url, needles(gone)))

    [receipt] = stack.forget("--session", "forget-a1", "--tenant", "alice")

    assert receipt["complete"] and receipt["what"] == "session" and receipt["sessions"] == 1
    assert receipt["events"] >= 6 and receipt["trajectories"] == 1 and receipt["session_records"] >= 1
    assert receipt["batches_rewritten"] == 1 and receipt["batch_rows_removed"] == 1
    assert receipt["parquet_files_rewritten"] == 1
    assert receipt["sampled_by_policy_versions"] == [0] and len(receipt["batches_handed_to_training"]) == 1
    assert nats_traces(stack.url, needles(gone)) == []
    assert file_traces(stack.root, needles(gone)) == []
    # The others: every trace they had is still there, and the batch holds them.
    after = nats_traces(stack.url, others)
    assert before and set(before) <= set(after)  # events, trajectories, records, assembler state: untouched
    assert any(t.startswith("OBJ_sg_batches") for t in after)  # the rewritten batch holds them
    assert _batch_rows(stack.batches) == ["forget-a2", "forget-b1"]
    # Idempotent: a second forget finds nothing left, and says so.
    [again] = stack.forget("--session", "forget-a1", "--tenant", "alice")
    assert again["complete"] and again["events"] == again["trajectories"] == again["batches_rewritten"] == 0


def test_forget_tenant_erases_a_hundred_sessions_and_nothing_of_another_tenant(stack: Stack) -> None:
    headers = {"authorization": "Bearer sk-carol"}
    for i in range(100):
        reply = httpx.post(f"{stack.gateway.base_url}/sessions/carol-{i}/v1/chat/completions", headers=headers,
                           json={"model": "tiny", "messages": [{"role": "user", "content": f"n{i}"}], "max_tokens": 2},
                           timeout=60)  # fmt: skip
        assert reply.status_code == 200
    kept = stack.turns("sk-alice", "forget-a3", "amber kite", turns=1)
    carol = tenant_id("carol").encode()
    _wait(lambda: len(nats_traces(stack.url, [carol])) >= 200, "carol's events never arrived")

    [receipt] = stack.forget("--tenant", "carol")

    assert receipt["what"] == "tenant" and receipt["sessions"] == 100 and receipt["events"] >= 200
    assert nats_traces(stack.url, [carol, b"carol-"]) == []
    assert any(t.startswith("SG_EVENTS") for t in nats_traces(stack.url, needles(kept)))


def _metric(base_url: str, name: str) -> float:
    for line in httpx.get(base_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


def test_a_replica_stopped_during_the_forget_never_brings_the_session_back(stack: Stack, tiny_model_path: Path) -> None:
    """A second replica holds a session's events in its outbox (NATS was away), is stopped while
    the session is forgotten, then continues and replays its outbox: the forgotten session's
    events are withheld, the other session's in the same outbox are published."""
    port, log = free_port(), stack.root / "r.log"
    command = [sys.executable, "-m", "stream_gateway.cli", "serve", "--model", str(tiny_model_path),
               "--served-model-name", "tiny", "--port", str(port), "--nats-url", stack.url,
               "--outbox-dir", str(stack.root / "outbox-r"), "--api-key-file", str(stack.root / "keys.txt"),
               "--log-level", "warning"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAM_GATEWAY_")}
    with log.open("a") as out:
        replica = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, text=True)
    base = f"http://127.0.0.1:{port}"
    headers = {"authorization": "Bearer sk-alice"}

    def chat(session_id: str, text: str) -> None:
        body = {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 3}
        reply = httpx.post(f"{base}/sessions/{session_id}/v1/chat/completions", json=body, headers=headers, timeout=60)
        assert reply.status_code == 200, reply.text

    try:
        wait_healthy(replica, port, log=log)
        chat("forget-r1", "hello saffron ridge")  # published: in the stream
        gone = httpx.get(f"{base}/sessions/forget-r1", headers=headers, timeout=30).json()
        # NATS down (killed: a pause would take the publishes in when it resumes, and the stream's
        # deduplication would then drop the replayed copies): the next turns' events go to the outbox.
        stack.nats.kill()
        try:
            chat("forget-r1", "hello again saffron ridge")
            chat("keep-r2", "hello indigo canyon")
            _wait(lambda: _metric(base, "gateway_events_outbox") >= 2, "nothing reached the outbox", timeout=30)
        finally:
            replica.send_signal(signal.SIGSTOP)
            stack.nats.restart()
        try:
            [receipt] = forget(stack.url, "--session", "forget-r1", "--tenant", "alice")
            assert receipt["events"] >= 1
        finally:
            replica.send_signal(signal.SIGCONT)
        # The outbox was replayed (the other session's events arrived from it), all of it.
        replayed = lambda: any(t.startswith("SG_EVENTS") for t in nats_traces(stack.url, [b".keep-r2."]))  # noqa: E731
        _wait(replayed, "the outbox was never replayed", timeout=60)
        _wait(lambda: _metric(base, "gateway_events_pending") == 0, "the outbox was not replayed whole", timeout=60)
        assert nats_traces(stack.url, needles(gone)) == []
        assert _metric(base, "gateway_events_withheld_total") >= 2
    finally:
        replica.send_signal(signal.SIGCONT)
        replica.terminate()
        replica.wait(timeout=60)


def test_nothing_to_forget_is_a_receipt_of_zeros_and_nats_away_is_refused(stack: Stack) -> None:
    [unknown] = forget(stack.url, "--session", "never-seen")
    assert unknown["complete"] and unknown["events"] == 0 and unknown["sessions"] == 0
    [tenant] = forget(stack.url, "--tenant", "nobody")
    assert tenant["complete"] and tenant["events"] == tenant["trajectories"] == tenant["session_records"] == 0
    command = [sys.executable, "-m", "stream_stack", "forget", "--nats-url", f"nats://127.0.0.1:{free_port()}",
               "--tenant", "alice"]  # fmt: skip
    refused = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "unreachable" in refused.stderr and "nothing was done" in refused.stderr
    assert refused.stdout == ""


def test_a_batcher_holding_a_forgotten_trajectory_drops_it(stack: Stack) -> None:
    """The batcher held the session's trajectory (its batch not full yet) when the forget ran: the
    next batch is made of later sessions only."""
    holding = _held_by_batcher(stack.url)
    held = stack.turns("sk-alice", "held-b1", "maple harbor", turns=1)
    _wait(lambda: any(t.startswith("SG_TRAJECTORIES") for t in nats_traces(stack.url, needles(held))),
          "its trajectory never came")  # fmt: skip
    _wait(lambda: _held_by_batcher(stack.url) > holding, "the batcher never took it")  # held for a batch of three
    [receipt] = stack.forget("--session", "held-b1", "--tenant", "alice")
    assert receipt["trajectories"] == 1 and receipt["batches_rewritten"] == receipt["batches_removed"] == 0
    for i in range(3):
        stack.turns("sk-alice", f"after-b{i}", f"after {i}", turns=1)
    # Batches take whole groups oldest first: had it stayed held, the first batch after it would hold it.
    _wait(lambda: {"after-b0", "after-b1"} <= set(_batch_rows(stack.batches)), "no batch after the forget")
    assert "held-b1" not in _batch_rows(stack.batches)
    assert nats_traces(stack.url, needles(held)) == [] and file_traces(stack.root, needles(held)) == []


def test_the_admin_route_ends_a_live_session_and_forgets_it(stack: Stack) -> None:
    base = stack.gateway.base_url
    headers = {"authorization": "Bearer sk-alice"}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello juniper delta"}], "max_tokens": 3}
    reply = httpx.post(f"{base}/sessions/admin-f1/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert reply.status_code == 200
    live = httpx.get(f"{base}/sessions/admin-f1", headers=headers, timeout=30).json()  # open: not closed
    assert live["closed"] is False
    _wait(lambda: any(t.startswith("SG_EVENTS") for t in nats_traces(stack.url, needles(live))), "no events")
    url = f"{base}/admin/forget"
    refused = httpx.post(url, json={"session_id": "admin-f1", "tenant": "alice"}, headers=headers, timeout=30)
    assert refused.status_code == 403
    bad = httpx.post(url, json={}, headers={"authorization": "Bearer sk-admin"}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "session_id"

    done = httpx.post(url, json={"session_id": "admin-f1", "tenant": "alice"},
                      headers={"authorization": "Bearer sk-admin"}, timeout=120)  # fmt: skip

    assert done.status_code == 200, done.text
    [receipt] = done.json()["data"]
    assert receipt["complete"] and receipt["events"] >= 3 and receipt["sessions"] == 1
    assert httpx.get(f"{base}/sessions/admin-f1", headers=headers, timeout=30).status_code == 404  # ended, dropped
    assert nats_traces(stack.url, needles(live)) == [] and file_traces(stack.root, needles(live)) == []


def test_forget_before_a_time_takes_the_sessions_begun_before_it_whole(stack: Stack) -> None:
    early = stack.turns("sk-dave", "dave-early", "early bird", turns=1)
    time.sleep(1.1)
    cut = time.time()
    time.sleep(0.1)
    late = stack.turns("sk-dave", "dave-late", "late owl", turns=1)
    _wait(lambda: any(t.startswith("SG_EVENTS") for t in nats_traces(stack.url, needles(late))), "no events")
    moment = datetime.fromtimestamp(cut, UTC).isoformat()

    [receipt] = stack.forget("--tenant", "dave", "--before", moment)

    assert receipt["sessions"] == 1 and receipt["before"] == pytest.approx(cut, abs=1e-3)
    assert nats_traces(stack.url, needles(early)) == []
    assert any(t.startswith("SG_EVENTS") for t in nats_traces(stack.url, needles(late)))
