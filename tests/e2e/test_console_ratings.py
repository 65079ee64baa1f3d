"""People rate from the console (issue 57), in a real browser (Debian's headless Chromium, Playwright).

Real parts only: a nats-server, a gateway capturing into it (the tiny model), the assembler, the
batcher and the console reading NATS, with the gateway's URL to send ratings to. A signed-in tenant
sees each turn's question before its answer, rates the session and a turn; the ratings are feedback
events with their author, and the session's trajectory, already emitted and held by the batcher,
reaches the next batch as a revision carrying the rating. An admin key reads but cannot rate; another
tenant cannot rate what is not theirs. No screenshots: test_console.py takes the docs' ones.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from openai import OpenAI

from consumers.assembler import AssemblerConfig, run_assembler
from consumers.batcher import BatcherConfig, run_batcher
from consumers.parquet import decode_batch
from consumers.trajectory import Trajectory
from pipeline.embedded import EmbeddedNatsServer
from pipeline.events import FeedbackRecorded, tenant_id
from stream_gateway import Settings
from stream_gateway.engines import build_engine
from stream_stack.console import ConsoleConfig, run_console

from ..support.capture import read_stream
from ..support.replicas import close_session
from ..support.servers import free_port, run_gateway
from ..support.waiting import wait_until
from .test_console import CHROMIUM, _up, visit
from .test_console import signed_in as console_signed_in

ALICE, BOB, ADMIN = "sk-alice", "sk-bob", "sk-admin"
QUESTION = "What is the capital of France?"


@dataclass
class Stack:
    gateway: str
    console: str
    batches: Path
    nats: str
    alice: str  # alice's tenant id, as events carry it

    def client(self, session: str) -> OpenAI:
        return OpenAI(base_url=self.gateway + "/v1", api_key=ALICE, default_headers={"x-session-id": session},
                      max_retries=0)  # fmt: skip


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("ratings")
    keys = tmp / "keys.txt"
    keys.write_text(f"{ALICE} alice\n{BOB} bob\n")
    settings = Settings(model=str(tiny_model_path), served_model_name="tiny", api_key_file=keys,
                        admin_api_keys=(ADMIN,), outbox_dir=tmp / "outbox")  # fmt: skip
    with EmbeddedNatsServer() as nats, anyio.from_thread.start_blocking_portal() as portal:
        settings = settings.model_copy(update={"nats_url": nats.url})
        with run_gateway(build_engine(settings), settings) as gateway:
            console = ConsoleConfig(servers=(nats.url,), index_path=None, port=free_port(), api_key_file=keys,
                                    admin_api_keys=(ADMIN,), tokenizers={"tiny": str(tiny_model_path)},
                                    gateway_url=gateway.base_url)  # fmt: skip
            assembler = AssemblerConfig(servers=(nats.url,), idle_timeout_s=30, close_grace_s=1)
            # Two rows a batch: the rated session's trajectory waits in the batcher for a partner.
            batcher = BatcherConfig.of(servers=(nats.url,), batch_size=2, group_size=1, prompt_length=1024,
                                       response_length=1024, no_reward="zero", output_dir=tmp / "batches")  # fmt: skip
            tasks = [portal.start_task_soon(run_assembler, assembler), portal.start_task_soon(run_console, console),
                     portal.start_task_soon(run_batcher, batcher)]  # fmt: skip
            wait_until(lambda: _up(console.url), timeout=30, what="the console listening")
            yield Stack(gateway.base_url, console.url.rstrip("/"), tmp / "batches", nats.url, tenant_id("alice"))
            for task in tasks:
                task.cancel()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        yield chromium
        chromium.close()


@contextlib.contextmanager
def signed_in(browser: Any, stack: Stack, key: str, session: str) -> Iterator[Any]:
    """test_console's sign-in (no page errors allowed), on the session's view."""
    with console_signed_in(browser, stack, key) as page:  # it reads stack.console only
        visit(page, f"{stack.console}/#/session/{session}")
        page.wait_for_selector("#tree .node")
        yield page


def _batch(stack: Stack) -> list[Trajectory]:
    files = sorted(stack.batches.glob("*.parquet")) if stack.batches.exists() else []
    return [t for f in files for t in decode_batch(f.read_bytes())[0]]


def _console_trajectories(stack: Stack, session: str) -> int:
    with httpx.Client(base_url=stack.console) as http:
        http.post("/api/login", json={"key": ALICE}).raise_for_status()
        found = http.get(f"/api/sessions/{session}")
        return len(found.json()["trajectories"]) if found.status_code == 200 else 0


def test_a_rating_from_the_console_reaches_the_next_batch_as_a_revision(stack: Stack, browser: Any) -> None:
    session = "rated"
    ask: Any = [{"role": "user", "content": QUESTION}]
    with stack.client(session) as client:
        first = client.chat.completions.create(model="tiny", messages=ask, max_tokens=6)
        follow: Any = [*ask, {"role": "assistant", "content": first.choices[0].message.content},
                       {"role": "user", "content": "And of Italy?"}]  # fmt: skip
        client.chat.completions.create(model="tiny", messages=follow, max_tokens=6)
    close_session(stack.gateway, ALICE, session)
    # Emitted (revision 0) and held by the batcher, waiting for a second row.
    wait_until(lambda: _console_trajectories(stack, session) == 1, timeout=60, what="the trajectory emitted")
    assert _batch(stack) == []

    with signed_in(browser, stack, ALICE, session) as page:
        # Each turn shows what was asked before its answer, as text.
        asked = page.locator("#tree .node .asked").all_inner_texts()
        assert len(asked) == 2 and QUESTION in asked[0] and "And of Italy?" in asked[1]
        assert "<|" not in asked[0]  # the template's special tokens are not shown
        assert page.locator("#tree .node").first.locator(".asked + .preview").count() == 1  # question, then answer
        assert page.locator("#tree .node [data-signal=accepted]").count() == 1  # the first turn was carried on
        # Rate the first turn, then the session.
        turn = page.locator("#tree .node form.rating").first
        turn.locator(".score").fill("0.5")
        turn.locator("button").click()
        page.wait_for_selector("#tree .node form.rating [data-rated='0.5']")
        whole = page.locator("form.rating[data-rate=session]")
        whole.locator(".score").fill("0.75")
        whole.locator(".note").fill("right, and concise")
        whole.locator("button").click()
        page.wait_for_selector("form.rating[data-rate=session] [data-rated='0.75']")

    # Feedback events with their author, through the gateway's own route.
    with ThreadPoolExecutor(1) as pool:  # Playwright's sync API holds this thread's event loop
        events = pool.submit(read_stream, stack.nats).result()
    feedback = [e for _, e in events if isinstance(e, FeedbackRecorded)]
    assert sorted((f.score, f.source, f.author, f.comment, f.turn_id is None) for f in feedback) == [
        (0.5, "console", stack.alice, None, False),
        (0.75, "console", stack.alice, "right, and concise", True),
    ]
    # Another session fills the batch: the rated trajectory goes in as its revision, with the rating.
    with stack.client("filler") as other:
        other.chat.completions.create(model="tiny", messages=ask, max_tokens=4)
    close_session(stack.gateway, ALICE, "filler")
    wait_until(lambda: len(_batch(stack)) == 2, timeout=60, what="the next batch")
    [rated] = [t for t in _batch(stack) if t.session_id == session]
    assert (rated.reward, rated.reward_source) == (0.75, "feedback") and rated.revision >= 1
    assert [t.reward for t in rated.turns] == [0.5, None]


def test_only_the_sessions_tenant_rates_it(stack: Stack, browser: Any) -> None:
    session = "not-yours"
    with stack.client(session) as client:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    wait_until(lambda: _has_session(stack, session), timeout=30, what="the session indexed")
    with signed_in(browser, stack, ADMIN, session) as page:
        assert page.locator("form.rating").count() == 0  # an admin reads every tenant, rates none
    for key, status in ((ADMIN, 403), (BOB, 404)):
        with httpx.Client(base_url=stack.console) as http:
            csrf = http.post("/api/login", json={"key": key}).json()["csrf"]
            refused = http.post(f"/api/sessions/{session}/feedback", json={"score": 1.0},
                                headers={"x-csrf-token": csrf})  # fmt: skip
            assert refused.status_code == status, refused.text
    with httpx.Client(base_url=stack.console) as http:
        csrf = http.post("/api/login", json={"key": ALICE}).json()["csrf"]
        assert http.post(f"/api/sessions/{session}/feedback", json={"score": 1.0}).status_code == 403  # no CSRF token
        bad = http.post(f"/api/sessions/{session}/feedback", json={"score": "good"}, headers={"x-csrf-token": csrf})
        assert bad.status_code == 400


def _has_session(stack: Stack, session: str) -> bool:
    with httpx.Client(base_url=stack.console) as http:
        http.post("/api/login", json={"key": ALICE}).raise_for_status()
        return http.get(f"/api/sessions/{session}").status_code == 200


async def _record_scores(url: str, tenant: str, session: str, trajectory_id: str) -> None:
    """Two verdicts as the reward worker records them (``sg_scores``, one create per key): a judge's
    score with its answer, and a verifier that timed out."""
    import nats
    from nats.js.errors import BucketNotFoundError

    from consumers.scores import ScoreRecord, score_key

    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        try:
            kv = await js.key_value("sg_scores")
        except BucketNotFoundError:
            kv = await js.create_key_value(bucket="sg_scores")
        common = {"trajectory_id": trajectory_id, "session_id": session, "tenant": tenant, "attempts": 1,
                  "duration_s": 0.1, "worker": "test:1", "at": 0.0}  # fmt: skip
        judge = ScoreRecord(scorer="judge", kind="judge", status="scored", score=0.8,
                            answer='{"score": 0.8} <b>sound</b>', **common)  # fmt: skip
        tests = ScoreRecord(scorer="tests", kind="command", status="timeout", error="no verdict in 5 s",
                            **common | {"attempts": 2})  # fmt: skip
        for record in (judge, tests):
            await kv.create(score_key(tenant, session, trajectory_id, record.scorer), record.encode())
    finally:
        await nc.close()


def test_a_trajectorys_scores_show_with_the_judges_answer(stack: Stack, browser: Any) -> None:
    session = "scored"
    with stack.client(session) as client:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": QUESTION}], max_tokens=4)
    close_session(stack.gateway, ALICE, session)
    wait_until(lambda: _console_trajectories(stack, session) == 1, timeout=60, what="the trajectory emitted")
    with httpx.Client(base_url=stack.console) as http:
        http.post("/api/login", json={"key": ALICE}).raise_for_status()
        [trajectory] = http.get(f"/api/sessions/{session}").json()["trajectories"]
        trajectory_id = trajectory["trajectory_id"]
        before = http.get(f"/api/trajectories/{trajectory_id}/tokens").json()["trajectory"]["scores"]
        assert before == []
        with ThreadPoolExecutor(1) as pool:  # Playwright's sync API holds this thread's event loop
            pool.submit(anyio.run, _record_scores, stack.nats, stack.alice, session, trajectory_id).result()
        scores = http.get(f"/api/trajectories/{trajectory_id}/tokens").json()["trajectory"]["scores"]
    assert [(s["scorer"], s["status"], s["score"], s["attempts"]) for s in scores] == [
        ("judge", "scored", 0.8, 1),
        ("tests", "timeout", None, 2),
    ]
    with signed_in(browser, stack, ALICE, session) as page:
        page.goto(f"{stack.console}/#/trajectory/{trajectory_id}")
        page.wait_for_selector("#scores li[data-scorer=judge]")
        judge = page.locator("#scores li[data-scorer=judge]").inner_text()
        assert "judge (judge): 0.8" in judge and '{"score": 0.8} <b>sound</b>' in judge  # the answer, as text
        tests = page.locator("#scores li[data-scorer=tests]").inner_text()
        assert "timeout: no verdict in 5 s after 2 tries" in tests
