"""The trajectory console in a real browser (Debian's headless Chromium, driven by Playwright).

Real parts only: a nats-server of its own, two gateway replicas capturing into it (the tiny model
on the transformers engine for tool calls and forks; the synthetic engine at a slow pace with the
same tokenizer, for a turn that is still streaming), the assembler, and the console reading NATS.
The page is driven as a user would: sign in with a key, find sessions, open a tree, read tokens.
Screenshots land in docs/console/ (the docs show what this run saw).
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from openai import OpenAI

from consumers.assembler import AssemblerConfig, run_assembler
from consumers.batcher import BatcherConfig, run_batcher
from pipeline.embedded import EmbeddedNatsServer
from stream_stack.console import ConsoleConfig, run_console

from ..support.replicas import close_session, tiny_and_slow
from ..support.servers import free_port
from ..support.waiting import wait_until

CHROMIUM = "/usr/bin/chromium"
SHOTS = Path(__file__).resolve().parents[2] / "docs" / "console"
XSS = ["<script>window.__xss = 1</script>", '<img src=x onerror="window.__xss = 2">', "[go](javascript:window.__xss=3)"]
ALICE, BOB, ADMIN = "sk-alice", "sk-bob", "sk-admin"
# A tool whose arguments are finite (an enum): the forced call always ends by itself, never at max_tokens.
READ_TOOL = {
    "type": "function",
    "function": {
        "name": "read",
        "description": "Read a file",
        "parameters": {"type": "object", "properties": {"path": {"enum": ["notes.txt", "todo.txt"]}},
                       "required": ["path"], "additionalProperties": False},
    },
}  # fmt: skip


@dataclass
class Stack:
    tiny: str  # the transformers replica's base URL
    slow: str  # the synthetic replica's
    console: str
    tmp: Path

    def client(self, key: str, base: str | None = None, **headers: str) -> OpenAI:
        return OpenAI(base_url=(base or self.tiny) + "/v1", api_key=key, default_headers=headers or None)

    def close(self, key: str, session: str) -> None:
        close_session(self.tiny, key, session)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("console")
    keys = tmp / "keys.txt"
    keys.write_text(f"{ALICE} alice\n{BOB} bob\n")
    with EmbeddedNatsServer() as nats, anyio.from_thread.start_blocking_portal() as portal:
        console = ConsoleConfig(servers=(nats.url,), index_path=tmp / "console.sqlite", port=free_port(),
                                api_key_file=keys, admin_api_keys=(ADMIN,),
                                tokenizers={"tiny": str(tiny_model_path)})  # fmt: skip
        assembler = AssemblerConfig(servers=(nats.url,), idle_timeout_s=3, close_grace_s=1, aborted="keep")
        # One trajectory a batch: with two, whichever trajectory the assembler closed last waited for a
        # partner that never came (five are admitted), and on a busy machine that was a tool chain.
        batcher = BatcherConfig.of(servers=(nats.url,), batch_size=1, group_size=1, prompt_length=1024,
                                   response_length=1024, no_reward="zero")  # fmt: skip
        tasks = [portal.start_task_soon(run_assembler, assembler), portal.start_task_soon(run_console, console),
                 portal.start_task_soon(run_batcher, batcher)]  # fmt: skip
        with tiny_and_slow(nats.url, tmp, tiny_model_path, api_key_file=keys, admin_api_keys=(ADMIN,)) as (a, b):
            wait_until(lambda: _up(console.url), timeout=30, what="the console listening")
            yield Stack(a, b, console.url.rstrip("/"), tmp)
        for task in tasks:
            task.cancel()


def _up(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(url, timeout=2).status_code == 200
    return False


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=CHROMIUM,
            args=["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"],
        )  # fmt: skip
        yield chromium
        chromium.close()


@contextlib.contextmanager
def signed_in(browser: Any, stack: Stack, key: str) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(stack.console + "/")
    page.fill("#key", key)
    page.click("#signin button[type=submit]")
    page.wait_for_selector("#sessions")
    yield page
    assert not errors, errors
    context.close()


def visit(page: Any, url: str) -> None:
    """Open a view by its address: a full load, so that no element of the view before it is waited for
    (a hash change alone re-renders in place, and the old view's elements would satisfy a wait)."""
    page.goto(url)
    page.reload()


def shot(page: Any, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=False)


def _tool_session(stack: Stack) -> str:
    """A tool call, its result and an answer; then the answer again (a retry: a fork)."""
    session = "tools-and-a-fork"
    client = stack.client(ALICE, **{"x-session-id": session, "user-agent": "console-test-agent/1"})
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Read notes.txt, then tell me what it says."}]
    first = client.chat.completions.create(model="tiny", messages=messages, tools=[READ_TOOL],  # type: ignore[list-item]
                                           tool_choice={"type": "function", "function": {"name": "read"}},
                                           max_tokens=300, temperature=0)  # fmt: skip
    call = first.choices[0].message.tool_calls[0]  # type: ignore[index]
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "notes: " + " ".join(XSS)},
    ]
    for _ in range(2):  # the same request twice: two continuations of the tool call's turn
        client.chat.completions.create(model="tiny", messages=messages, tools=[READ_TOOL], max_tokens=12)  # type: ignore[arg-type,list-item]
    stack.close(ALICE, session)
    return session


def _xss_session(stack: Stack) -> str:
    session = "xss"
    agent = XSS[1]
    client = stack.client(ALICE, **{"x-session-id": session, "user-agent": agent})
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": " ".join(XSS)}], max_tokens=6)
    stack.close(ALICE, session)
    return session


def _aborted_session(stack: Stack) -> str:
    """A stream the client walks away from: its turn is aborted (client_disconnected)."""
    session = "walked-away"
    client = stack.client(ALICE, stack.slow, **{"x-session-id": session})
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "long story"}],
                                            max_tokens=400, stream=True)  # fmt: skip
    for count, _chunk in enumerate(stream):
        if count >= 3:
            break
    stream.close()
    return session


def _index_has(stack: Stack, key: str, session: str, trajectories: int) -> bool:
    with httpx.Client(base_url=stack.console) as http:
        http.post("/api/login", json={"key": key}).raise_for_status()
        found = http.get(f"/api/sessions/{session}")
        return found.status_code == 200 and len(found.json()["trajectories"]) >= trajectories


def _batched(stack: Stack, session: str) -> int:
    with httpx.Client(base_url=stack.console) as http:
        http.post("/api/login", json={"key": ALICE}).raise_for_status()
        return sum(1 for t in http.get(f"/api/sessions/{session}").json()["trajectories"] if t["batch_id"])


def test_the_console_shows_sessions_trees_tokens_and_flags_to_their_tenant_only(stack: Stack, browser: Any) -> None:
    tools = _tool_session(stack)
    xss = _xss_session(stack)
    aborted = _aborted_session(stack)
    stack.client(BOB, **{"x-session-id": "bobs-own"}).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "bob here"}], max_tokens=4
    )
    too_long = "too-long"  # its prompt passes the batcher's prompt_length (1024): left out, and said why
    stack.client(ALICE, **{"x-session-id": too_long}).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "word " * 1500}], max_tokens=4
    )
    stack.close(ALICE, too_long)
    wait_until(lambda: _index_has(stack, ALICE, tools, 2), timeout=60, what="the tool session's two chains indexed")
    wait_until(lambda: _index_has(stack, ALICE, aborted, 1), timeout=60, what="the aborted chain indexed (idle)")

    with signed_in(browser, stack, ALICE) as page:
        rows = page.locator("#sessions tr")
        wait_until(lambda: rows.count() == 4, timeout=10, what="alice's four sessions listed")
        assert "bobs-own" not in page.inner_text("#sessions")  # another tenant's session is not there
        shot(page, "sessions")

        # A flagged trajectory is found by its flag: the list filtered by `aborted`.
        page.locator("#sessions tr[data-session='walked-away'] .flag[data-flag='aborted']").click()
        page.wait_for_function("location.hash.includes('flag=aborted')")
        wait_until(lambda: page.locator("#sessions tr").count() == 1, timeout=10, what="the filter applied")
        assert page.inner_text("#sessions").startswith("walked-away")

        # Into training: the batcher put the two chains of the tool session into batches.
        visit(page, f"{stack.console}/#/session/{tools}")
        page.wait_for_selector("#trajectories tr[data-trajectory]")
        wait_until(lambda: _batched(stack, tools) == 2, timeout=30, what="the tool session's chains batched")

        # The tree: the tool call's turn with two children, the fork's cause said.
        visit(page, f"{stack.console}/#/session/{tools}")
        page.wait_for_selector("#tree .node")
        assert page.locator("#tree .node").count() == 3
        assert "tool call: read" in page.inner_text("#tree")
        causes = page.locator("#tree .badge.cause")
        assert causes.count() == 2 and "fork: another continuation" in causes.first.inner_text()
        shot(page, "session-tree")

        # Tokens as training sees them: the tool call sampled, the tool result, the template; the
        # shared tool-call turn in the loss of one chain (the one that trains it), untrained in the other.
        seen: dict[str, set[str]] = {}
        for link in [a.get_attribute("href") or "" for a in page.locator("#trajectories a").all()]:
            visit(page, f"{stack.console}/{link}")
            page.wait_for_selector("#tokens .tok")
            seen[link] = set(page.eval_on_selector_all("#tokens .tok", "nodes => nodes.map(n => n.dataset.kind)"))
        assert len(seen) == 2
        owner = next(link for link, kinds in seen.items() if "tool-call" in kinds)
        other = next(link for link in seen if link != owner)
        assert {"template", "prompt", "system", "tool-call", "tool-result", "sampled"} <= seen[owner], seen
        assert "untrained" not in seen[owner] and "untrained" in seen[other] and "tool-call" not in seen[other]
        visit(page, f"{stack.console}/{owner}")
        page.wait_for_selector("#tokens .tok")
        sampled = page.locator("#tokens .tok[data-kind='tool-call']").first
        title = sampled.get_attribute("title") or ""
        assert "logprob" in title and "version v0" in title and "position" in title
        sampled.click()
        page.locator("#tokens .tok[data-kind='tool-call']").last.click(modifiers=["Shift"])
        assert page.inner_text("#range").startswith("token_ids[")
        shot(page, "trajectory-tokens")
        # The XSS strings of the tool result are text on the page, and ran nothing.
        assert page.evaluate("window.__xss") is None

        # Why a trajectory is in no batch: the batcher's reason, from its bucket.
        visit(page, f"{stack.console}/#/session/{too_long}")
        page.wait_for_selector("#trajectories tr[data-trajectory]")
        wait_until(lambda: "dropped: length" in page.inner_text("#trajectories") or page.reload() is None,
                   timeout=30, what="the drop reason shown")  # fmt: skip

        # The two chains side by side: the shared turn, and none of its sampled tokens in both losses.
        visit(page, f"{stack.console}/#/session/{tools}")
        page.wait_for_selector("#trajectories input[type=checkbox]")
        for box in page.locator("#trajectories input[type=checkbox]").all():
            box.check()
        page.click("text=Compare the two chosen")
        page.wait_for_selector("#compare")
        compare = page.inner_text("#compare")
        assert "shared turns\n1" in compare.replace("\t", "\n")
        assert int(page.inner_text("#twice")) == 0  # train-once: the assembler's default
        shot(page, "compare")

        # XSS through the agent header, the prompt and the tool result: shown, never run.
        visit(page, f"{stack.console}/#/session/{xss}")
        page.wait_for_selector("#tree .node")
        assert XSS[1] in page.inner_text("main")
        assert page.evaluate("window.__xss") is None
        assert page.locator("main img").count() == 0 and page.locator("main script").count() == 0

    # Another tenant's key sees none of it; a session id of alice's is not found for bob.
    with signed_in(browser, stack, BOB) as page:
        wait_until(lambda: page.locator("#sessions tr").count() == 1, timeout=10, what="bob's one session")
        assert page.inner_text("#sessions").startswith("bobs-own")
        visit(page, f"{stack.console}/#/session/{tools}")
        page.wait_for_selector("#view [role=alert]")
        assert "No session" in page.inner_text("#view [role=alert]")


def test_a_live_turn_appears_token_by_token(stack: Stack, browser: Any) -> None:
    session = "live-one"
    client = stack.client(ALICE, stack.slow, **{"x-session-id": session})
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    wait_until(lambda: _index_has(stack, ALICE, session, 0), timeout=30, what="the session indexed")
    with signed_in(browser, stack, ALICE) as page:
        visit(page, f"{stack.console}/#/session/{session}")
        page.wait_for_selector("#tree .node")
        page.wait_for_selector("#live[data-ready]")  # subscribed: what is sampled from now on is shown
        done = threading.Event()

        def talk() -> None:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "go on"}], max_tokens=60)
            done.set()

        threading.Thread(target=talk, daemon=True).start()
        page.wait_for_selector("#live .tok", timeout=20_000)
        first = page.locator("#live .tok").count()
        assert not done.is_set(), "the turn finished before its first tokens were shown"
        wait_until(lambda: page.locator("#live .tok").count() > first, timeout=20, what="more tokens arriving")
        shot(page, "live")
        assert done.wait(30)
        wait_until(lambda: page.locator("#live .tok").count() == 60, timeout=10, what="every token shown")


def test_an_admin_forgets_a_session_from_the_console(stack: Stack, browser: Any) -> None:
    session = "forget-me"
    stack.client(BOB, **{"x-session-id": session}).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "please forget this"}], max_tokens=4
    )
    stack.close(BOB, session)
    wait_until(lambda: _index_has(stack, BOB, session, 1), timeout=60, what="the session indexed")
    with signed_in(browser, stack, ADMIN) as page:
        assert "every tenant" in page.inner_text("#who")
        visit(page, f"{stack.console}/#/session/{session}")
        page.wait_for_selector("#forget")
        page.on("dialog", lambda dialog: dialog.accept())
        page.click("#forget")
        page.wait_for_selector("#receipt:not([hidden])", timeout=60_000)
        receipt = json.loads(page.inner_text("#receipt"))
        assert receipt["complete"] is True and receipt["events"] > 0 and receipt["trajectories"] == 1
        shot(page, "forget")
        visit(page, f"{stack.console}/#/sessions")
        page.wait_for_selector("#sessions")
        assert session not in page.inner_text("#sessions")
        visit(page, f"{stack.console}/#/loop")
        page.wait_for_selector("#batches")
        shot(page, "loop")
    # No trace: not in the index, not in the streams.
    with httpx.Client(base_url=stack.console) as http:
        http.post("/api/login", json={"key": ADMIN}).raise_for_status()
        assert http.get(f"/api/sessions/{session}").status_code == 404


def test_the_api_refuses_what_it_must(stack: Stack) -> None:
    with httpx.Client(base_url=stack.console) as http:
        assert http.get("/api/sessions").status_code == 401  # no cookie
        refused = http.post("/api/login", json={"key": "sk-nobody"})
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        assert http.post("/api/login", content=b"{not json").status_code == 400
        signed = http.post("/api/login", json={"key": ALICE})
        cookie = signed.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie and ALICE.lower() not in cookie
        # A state-changing request without the CSRF header is refused, even with the cookie.
        assert http.post("/api/logout").status_code == 403
        assert http.post("/api/sessions/x/forget").status_code == 403
        assert http.get("/api/sessions", params={"limit": "many"}).status_code == 400
        assert http.get("/api/trajectories/nope/tokens").status_code == 404
        page = http.get("/")
        assert "script-src 'self'" in page.headers["content-security-policy"]
    # /metrics: counts only, the same flags, end reasons and drop reasons as the pages.
    metrics = httpx.get(f"{stack.console}/metrics").text
    assert 'sg_console_trajectories_health{flag="forked"} 2' in metrics, metrics  # the tool session's two chains
    assert 'sg_console_trajectories_dropped{reason="length"} 1' in metrics
    assert 'sg_console_trajectories_end_reason{reason="client_disconnected"} 1' in metrics
