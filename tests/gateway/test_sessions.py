"""Sessions and token-exact multi-turn context (T1-T3 of docs/sessions.md), with the real tiny model.

The tiny model's replies are random text, which is what makes these tests sharp: re-tokenizing
random text almost never gives back the sampled ids, so a prompt that contains the sampled ids
verbatim proves the echoed message was not re-tokenized.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from openai import OpenAI
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from ..support.fidelity import assert_chain_logprobs
from ..support.servers import RunningGateway

SYSTEM = {"role": "system", "content": "You are a test."}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture
def session_id() -> str:
    return f"test{secrets.token_hex(6)}"


@pytest.fixture
def session_client(gateway: RunningGateway, session_id: str) -> Iterator[OpenAI]:
    """An OpenAI client whose base URL names a session: all an agent needs to configure."""
    base = f"{gateway.base_url}/sessions/{session_id}/v1"
    with OpenAI(base_url=base, api_key="sk-alice", timeout=60, max_retries=0) as c:
        yield c


def _reply(client: OpenAI, messages: list[dict[str, Any]], *, stream: bool = False, **kw: Any) -> dict[str, Any]:
    """Send ``messages``; return the assistant message as a client would echo it."""
    if not stream:
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, **kw)  # type: ignore[arg-type]
        return {"role": "assistant", "content": r.choices[0].message.content}
    parts = []
    for chunk in client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, stream=True, **kw):  # type: ignore[call-overload]
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
    return {"role": "assistant", "content": "".join(parts)}


def _session(gateway: RunningGateway, session_id: str, key: str = "sk-alice") -> dict[str, Any]:
    r = httpx.get(f"{gateway.base_url}/sessions/{session_id}", headers={"authorization": f"Bearer {key}"}, timeout=10)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def _context_builds(gateway: RunningGateway, metric: str = "gateway_context_builds_total") -> dict[str, float]:
    """A ``{kind="cold"|"warm"}`` counter of the gateway's ``/metrics``."""
    text = httpx.get(gateway.base_url + "/metrics", timeout=10).text
    builds = {"cold": 0.0, "warm": 0.0}
    for line in text.splitlines():
        for kind in builds:
            if line.startswith(f'{metric}{{kind="{kind}"}}'):
                builds[kind] = float(line.rsplit(" ", 1)[1])
    return builds


def _metric(gateway: RunningGateway, name: str) -> float:
    text = httpx.get(gateway.base_url + "/metrics", timeout=10).text
    return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " "))


def _held_tokens(gateway: RunningGateway) -> float:
    text = httpx.get(gateway.base_url + "/metrics", timeout=10).text
    return next(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("gateway_session_tokens_held ")
    )


def test_a_continuing_turn_tokenizes_what_it_adds_however_long_the_history(
    session_client: OpenAI, gateway: RunningGateway, session_id: str
) -> None:
    """Issue 41, through the gateway's own counters: each continuation of a growing tool loop
    tokenizes about the text it appends and runs the chat template for the messages it appends
    (the body repeats the last one's bytes: the kept history's render is replayed), while the
    conversation it carries grows past ten times that; and the session holds each of its token
    ids once, not once per turn that carries it."""
    chars = "gateway_context_tokenized_chars_total"
    rendered = "gateway_template_rendered_messages_total"
    held = _held_tokens(gateway)
    hits = _metric(gateway, "gateway_history_cache_hits_total")
    messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "Read the files."}]
    seen, ran = [], []
    for n in range(14):
        before, before_ran = _context_builds(gateway, chars), _context_builds(gateway, rendered)
        messages.append(_reply(session_client, messages))
        after, after_ran = _context_builds(gateway, chars), _context_builds(gateway, rendered)
        seen.append((after["cold"] - before["cold"], after["warm"] - before["warm"]))
        ran.append(after_ran["warm"] - before_ran["warm"])
        result = "".join(f"file {n} line {i}: {'text ' * 6}\n" for i in range(50))
        messages.append({"role": "user", "content": result})
    history = sum(len(str(m["content"])) for m in messages)
    cold, _ = seen[0]
    assert cold > 0 and all(c == 0 for c, _ in seen[1:])  # the first turn alone tokenized its whole render
    added = len(result)
    for _, warm in seen[2:]:  # each later one: its new message, the echoed answer, the template around them
        assert 0 < warm <= added + 300
    assert history > 10 * (added + 300)
    # From the turn whose body is big enough to keep (4 KiB), each later one replays the render
    # and runs the template for its two new messages alone.
    assert ran[-10:] == [2] * 10, ran
    assert _metric(gateway, "gateway_history_cache_hits_total") - hits >= 10
    turns = _session(gateway, session_id)["turns"]
    carried = sum(len(t["prompt_ids"]) + len(t["output_ids"]) for t in turns)  # what 14 tuples held
    tokens = len(turns[-1]["prompt_ids"]) + len(turns[-1]["output_ids"])
    sampled = sum(len(t["output_ids"]) for t in turns)  # an answer's end may be re-rendered, not reused
    assert tokens <= _held_tokens(gateway) - held <= tokens + sampled < carried / 4


def _chain_turns(body: dict[str, Any]) -> list[list[str]]:
    return sorted(c["turn_ids"] for c in body["chains"])


def test_multi_turn_chain_reuses_sampled_ids(
    session_client: OpenAI, gateway: RunningGateway, session_id: str, tokenizer: PreTrainedTokenizerBase
) -> None:
    messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "first question"}]
    builds = _context_builds(gateway)
    for i in range(3):
        messages.append(_reply(session_client, messages, stream=i % 2 == 1))
        messages.append({"role": "user", "content": f"follow-up {i}"})
    _reply(session_client, messages)
    after = _context_builds(gateway)
    # The first turn tokenized its whole render; each continuation only what it added (issue 41).
    assert (after["cold"] - builds["cold"], after["warm"] - builds["warm"]) == (1, 3)
    body = _session(gateway, session_id)
    turns = body["turns"]
    assert len(turns) == 4
    for k, turn in enumerate(turns):  # what each says of a fresh tokenization is what one gives
        text = tokenizer.apply_chat_template(messages[: 2 + 2 * k], add_generation_prompt=True, tokenize=False)
        fresh = tokenizer.encode(str(text), add_special_tokens=False)
        assert turn["matches_full_render"] == (fresh == turn["prompt_ids"])
    assert [t["parent_id"] for t in turns] == [None] + [t["turn_id"] for t in turns[:-1]]
    re_tokenized_differs = 0
    for parent, child in itertools.pairwise(turns):
        sampled = parent["prompt_ids"] + parent["output_ids"]
        assert child["prompt_ids"][: len(sampled)] == sampled  # T2: verbatim, never re-tokenized
        assert child["reused_prompt_tokens"] == len(sampled)
        # Only the new messages were tokenized, as the template renders them at that position.
        tail = tokenizer.decode(child["prompt_ids"][len(sampled) :])
        assert "<|im_start|>user\nfollow-up" in tail and tail.endswith("<|im_start|>assistant\n")
        text = parent["message"]["content"]
        re_tokenized_differs += tokenizer.encode(text, add_special_tokens=False) != parent["output_ids"][: -1 or None]
    assert re_tokenized_differs > 0, "random replies should not survive re-tokenization; the test lost its edge"
    [chain] = body["chains"]
    assert chain["turn_ids"] == [t["turn_id"] for t in turns]
    last = turns[-1]
    assert chain["token_ids"] == last["prompt_ids"] + last["output_ids"]
    assert len(chain["mask"]) == len(chain["logprobs"]) == len(chain["token_ids"])
    for turn in turns:  # T1: every assistant span is exactly the sampled ids, masked 1, logprobs aligned
        start = len(turn["prompt_ids"])
        span = slice(start, start + len(turn["output_ids"]))
        assert chain["token_ids"][span] == turn["output_ids"]
        assert chain["logprobs"][span] == turn["logprobs"]
        assert set(chain["mask"][span]) == {1}
    assert sum(chain["mask"]) == sum(len(t["output_ids"]) for t in turns)
    assert all(lp == 0.0 for lp, m in zip(chain["logprobs"], chain["mask"], strict=True) if m == 0)


def test_chain_tokens_reproduce_recorded_logprobs(
    session_client: OpenAI, gateway: RunningGateway, session_id: str, tiny_model_path: Path
) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    for i in range(3):
        messages.append(_reply(session_client, messages, temperature=0.8, seed=i))
        messages.append({"role": "user", "content": f"more {i}"})
    [chain] = _session(gateway, session_id)["chains"]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    assert_chain_logprobs(model, chain["token_ids"], chain["mask"], chain["logprobs"], temperature=0.8)


def test_client_reserialisation_still_continues_the_chain(
    session_client: OpenAI, gateway: RunningGateway, session_id: str
) -> None:
    """Content as parts, surrounding whitespace, developer for system: the same conversation."""
    first = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "one"}]
    reply = _reply(session_client, first)
    echoed = {"role": "assistant", "content": [{"type": "text", "text": reply["content"] or ""}]}
    second = [
        {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "user", "content": " one "},
        echoed,
        {"role": "user", "content": [{"type": "text", "text": "two"}]},
    ]
    _reply(session_client, second)
    body = _session(gateway, session_id)
    assert _chain_turns(body) == [[t["turn_id"] for t in body["turns"]]]


def test_empty_reply_echoed_as_null_continues(session_client: OpenAI, gateway: RunningGateway, session_id: str) -> None:
    """A reply that is empty (a stop string at its very start) may come back as ``content: null``."""
    first = [{"role": "user", "content": "say nothing"}]
    probe = session_client.chat.completions.create(
        model="tiny", messages=first, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    leading = (probe.choices[0].message.content or "x")[0]
    empty = session_client.chat.completions.create(
        model="tiny", messages=first, max_tokens=8, temperature=0, stop=[leading], extra_body={"ignore_eos": True}
    )
    assert empty.choices[0].message.content == ""
    _reply(session_client, [*first, {"role": "assistant", "content": None}, {"role": "user", "content": "again"}])
    body = _session(gateway, session_id)
    continued = body["turns"][-1]
    assert continued["parent_id"] == body["turns"][1]["turn_id"]  # the empty turn, the most recent match


def test_edit_retry_and_subagents_make_separate_correct_chains(
    session_client: OpenAI, gateway: RunningGateway, session_id: str
) -> None:
    u1 = {"role": "user", "content": "question one"}
    a1 = _reply(session_client, [SYSTEM, u1])
    a2 = _reply(session_client, [SYSTEM, u1, a1, {"role": "user", "content": "question two"}])
    # Retry from an older turn: a sibling of the second turn.
    _reply(session_client, [SYSTEM, u1, a1, {"role": "user", "content": "question two, reworded"}])
    # Edited history: the first user message changed, so nothing matches: a new root.
    _reply(session_client, [SYSTEM, {"role": "user", "content": "question one (edited)"}, a1, u1])
    # Two interleaved sub-agents with their own system prompts, in the same session.
    sub: dict[str, list[dict[str, Any]]] = {
        name: [{"role": "system", "content": f"sub-agent {name}"}, {"role": "user", "content": "task"}]
        for name in ("x", "y")
    }
    for _ in range(2):
        for name in ("x", "y"):
            sub[name].append(_reply(session_client, sub[name]))
            sub[name].append({"role": "user", "content": "continue"})
    body = _session(gateway, session_id)
    turns = {t["turn_id"]: t for t in body["turns"]}
    order = [t["turn_id"] for t in body["turns"]]
    t1, t2, t2b, edited, x1, y1, x2, y2 = order
    assert turns[t2]["parent_id"] == t1 and turns[t2b]["parent_id"] == t1
    assert turns[edited]["parent_id"] is None
    assert turns[x1]["parent_id"] is None and turns[y1]["parent_id"] is None
    assert turns[x2]["parent_id"] == x1 and turns[y2]["parent_id"] == y1
    assert _chain_turns(body) == sorted([[t1, t2], [t1, t2b], [edited], [x1, x2], [y1, y2]])
    assert a2["content"] is not None
    for chain in body["chains"]:  # never spliced: each chain is the leaf's own prompt plus output
        leaf = turns[chain["turn_ids"][-1]]
        assert chain["token_ids"] == leaf["prompt_ids"] + leaf["output_ids"]


def test_sessions_are_found_automatically_and_scoped_by_key(gateway: RunningGateway) -> None:
    def client(key: str) -> OpenAI:
        return OpenAI(base_url=gateway.base_url + "/v1", api_key=key, timeout=60, max_retries=0)

    u = [{"role": "user", "content": f"automatic {secrets.token_hex(4)}"}]
    with client("sk-bob") as bob, client("sk-eve") as eve:
        first = bob.chat.completions.with_raw_response.create(model="tiny", messages=u, max_tokens=6)  # type: ignore[arg-type]
        session = first.headers["x-session-id"]
        echo = {"role": "assistant", "content": first.parse().choices[0].message.content}
        follow = [*u, echo, {"role": "user", "content": "next"}]
        second = bob.chat.completions.with_raw_response.create(model="tiny", messages=follow, max_tokens=6)  # type: ignore[arg-type]
        assert second.headers["x-session-id"] == session
        # The same conversation under another key is someone else's: a new session.
        other = eve.chat.completions.with_raw_response.create(model="tiny", messages=follow, max_tokens=6)  # type: ignore[arg-type]
        assert other.headers["x-session-id"] != session
        # X-Session-Id names a session explicitly.
        named = bob.chat.completions.with_raw_response.create(
            model="tiny",
            messages=u,
            max_tokens=6,
            extra_headers={"X-Session-Id": "bob-explicit"},  # type: ignore[arg-type]
        )
        assert named.headers["x-session-id"] == "bob-explicit"
    body = _session(gateway, session, key="sk-bob")
    assert len(body["turns"]) == 2 and len(body["chains"]) == 1
    # Another tenant's session id answers exactly as an id nobody used (issue 55): nothing tells eve
    # which names bob uses, and the message still says how sessions are scoped.
    hidden = httpx.get(f"{gateway.base_url}/sessions/{session}", headers={"authorization": "Bearer sk-eve"}, timeout=10)
    unused = httpx.get(f"{gateway.base_url}/sessions/{session}x", headers={"authorization": "Bearer sk-eve"}, timeout=10)
    assert hidden.status_code == unused.status_code == 404
    assert hidden.json()["error"]["code"] == unused.json()["error"]["code"] == "session_not_found"
    assert hidden.json()["error"]["message"] == unused.json()["error"]["message"].replace(f"{session}x", session)
    assert "sessions belong to the key that created them" in hidden.json()["error"]["message"]


def test_bad_session_ids_are_refused(gateway: RunningGateway) -> None:
    r = httpx.post(
        gateway.base_url + "/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]},
        headers={"x-session-id": "x" * 300},
        timeout=10,
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "session_id"


def test_a_failed_request_leaves_no_session(gateway: RunningGateway) -> None:
    r = httpx.post(
        f"{gateway.base_url}/sessions/doomed/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 10**9},
        timeout=10,
    )
    assert r.status_code == 400
    assert httpx.get(f"{gateway.base_url}/sessions/doomed", timeout=10).status_code == 404


def test_store_is_bounded_and_its_index_follows_evictions() -> None:
    from stream_gateway.sessions._store import SessionStore, Turn

    store = SessionStore(max_sessions=2)
    sessions = [store.create("t") for _ in range(3)]
    assert len(store) == 2
    for i, session in enumerate(sessions):
        turn = Turn(
            f"turn{i}", session.session_id, None, bytes([i]) * 16, 1, (1,), 0, (2,), (-0.1,), "stop", "", (),
            0, ((0, 0),), 0.0, None, 0.0, True, None,
        )  # fmt: skip
        store.add_turn(session, turn)
    assert store.find_at("t", [bytes([0]) * 16, b"next"], [0]) is None  # evicted with its session
    found = store.find_at("t", [bytes([2]) * 16, b"next"], [0])
    assert found is not None and found[1].turn_id == "turn2"
    assert store.find_at("other-tenant", [bytes([2]) * 16, b"next"], [0]) is None


def test_store_is_bounded_by_the_token_ids_its_sessions_hold() -> None:
    from stream_gateway.sessions._store import SessionStore, Turn

    closed: list[tuple[str, str]] = []
    store = SessionStore(max_tokens=2_500, on_close=lambda s, reason: closed.append((s.session_id, reason)))

    def turn(session_id: str, n: int, tokens: int) -> Turn:
        return Turn(
            f"{session_id}-{n}", session_id, None, None, 1, tuple(range(tokens)), 0, (7,), (-0.1,), "stop", "", (),
            0, ((0, 0),), 0.0, None, 0.0, True, None,
        )  # fmt: skip

    first, second, third = (store.create("t") for _ in range(3))
    store.add_turn(first, turn(first.session_id, 0, 999))
    store.add_turn(second, turn(second.session_id, 0, 999))
    assert store.held_tokens == 2_000 and first.held_tokens == second.held_tokens == 1_000
    store.touch(first)  # the first is now the most recently used
    store.add_turn(third, turn(third.session_id, 0, 999))
    store.touch(third)  # over the bound: the least recently used (the second) goes
    assert [s.session_id for s in store] == [first.session_id, third.session_id]
    assert closed == [(second.session_id, "evicted")] and store.held_tokens == 2_000
    # One session alone over the bound is kept: it is the one in use.
    store.add_turn(third, turn(third.session_id, 1, 4_999))
    store.touch(third)
    assert [s.session_id for s in store] == [third.session_id] and store.held_tokens == 6_000


def test_a_length_finish_says_whether_max_tokens_or_the_context_window_stopped_it(tiny_model_path: Path) -> None:
    """``length_cause``: the client's cap, or the end of the window (no cap asked: the window is the cap)."""
    from stream_gateway import Settings
    from stream_gateway.engines import build_engine

    from ..support.servers import run_gateway

    settings = Settings(model=str(tiny_model_path), served_model_name="tiny", max_model_len=64)
    with run_gateway(build_engine(settings), settings) as gateway:
        base = f"{gateway.base_url}/sessions/lengths"
        with OpenAI(base_url=f"{base}/v1", api_key="k", max_retries=0, timeout=60) as client:
            ask = [{"role": "user", "content": "hi"}]
            capped = client.chat.completions.create(
                model="tiny", messages=ask, max_tokens=3, extra_body={"ignore_eos": True}
            )  # type: ignore[arg-type]
            window = client.chat.completions.create(model="tiny", messages=ask, extra_body={"ignore_eos": True})  # type: ignore[arg-type]
        turns = httpx.get(base, headers={"authorization": "Bearer k"}, timeout=30).json()["turns"]
    assert capped.choices[0].finish_reason == window.choices[0].finish_reason == "length"
    assert [t["length_cause"] for t in turns] == ["max_tokens", "context"]
    assert len(turns[1]["prompt_ids"]) + len(turns[1]["output_ids"]) == 64
