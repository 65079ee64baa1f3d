"""Real agents against a thinking model: rollouts -> trajectories equals the history policy's number.

THUDM/slime#2288 saw 8 Claude Code rollouts become 64 training samples because each echo of the
thinking forked the prompt. Here each agent runs twice (a run, then a resumed one: two user
messages) against ``tiny-reasoning`` (or its per-agent variant); under ``--reasoning-history keep``
the session is one chain, under ``template`` one root per user message, whatever the agent did
with the thinking it was streamed. The chains are token-exact (a forward pass reproduces them).
OpenClaw moves its internal-context message to the end of every request, so each of its turns is a
root with or without thinking: its test checks that the thinking adds no root of its own.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from stream_gateway import Settings
from stream_gateway.engines import build_engine
from stream_gateway.models import resolve_model

from ..support.agents import ensure_agents_installed, openclaw_workspace, run_claude, run_codex, run_openclaw, run_pi
from ..support.fidelity import assert_chain_logprobs
from ..support.servers import RunningGateway, run_gateway

pytestmark = pytest.mark.timeout(900)  # the first test may install the agents

README = "The secret word is lighthouse.\n"
MODELS = {"pi": "tiny-reasoning", "claude": "tiny-reasoning-claude", "codex": "tiny-reasoning-codex"}


@pytest.fixture(scope="module")
def agents() -> Path:
    return ensure_agents_installed()


@pytest.fixture(scope="module", params=["keep", "template"])
def history(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _gateway(name: str, history: str) -> Iterator[tuple[RunningGateway, Path]]:
    path = Path(resolve_model(name))
    settings = Settings(model=str(path), served_model_name=name, default_temperature=0.0, reasoning_history=history)
    with run_gateway(build_engine(settings), settings) as running:
        yield running, path


def _check(gateway: RunningGateway, session: str, key: str, history: str, model: Path) -> dict[str, Any]:
    response = httpx.get(f"{gateway.base_url}/sessions/{session}", headers={"x-api-key": key}, timeout=30)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    turns = body["turns"]
    assert all(t["reasoning_tokens"] > 0 for t in turns), [t["reasoning_tokens"] for t in turns]
    roots = [t for t in turns if t["parent_id"] is None]
    # Two rollouts (user messages): one trajectory under keep, one per user message under template.
    assert len(body["chains"]) == len(roots) == (1 if history == "keep" else 2), [
        (t["parent_id"], t["fallback_reason"]) for t in turns
    ]
    reference = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    for chain in body["chains"]:
        assert_chain_logprobs(reference, chain["token_ids"], chain["mask"], chain["logprobs"], atol=5e-4)
    return body


def test_pi_two_rollouts_follow_the_policy(agents: Path, history: str, tmp_path: Path) -> None:
    for gateway, model in _gateway(MODELS["pi"], history):
        session = f"pi{secrets.token_hex(4)}"
        base = f"{gateway.base_url}/sessions/{session}"
        (tmp_path / "README.md").write_text(README)
        saved = tmp_path / "pi-session"
        first = run_pi(base, MODELS["pi"], "What does the README say?", tmp_path, continue_session_dir=saved)
        assert first.returncode == 0 and "read" in first.tools_used, first.describe()
        second = run_pi(base, MODELS["pi"], "Read it once more.", tmp_path, continue_session_dir=saved)
        assert second.returncode == 0, second.describe()
        _check(gateway, session, "sk-local", history, model)


def test_codex_two_rollouts_follow_the_policy(agents: Path, history: str, tmp_path: Path) -> None:
    for gateway, model in _gateway(MODELS["codex"], history):
        workdir, home = tmp_path / "project", tmp_path / "home"
        workdir.mkdir()
        home.mkdir()
        (workdir / "README.md").write_text(README)
        session = f"codex{secrets.token_hex(4)}"
        base = f"{gateway.base_url}/sessions/{session}"
        first = run_codex(base, MODELS["codex"], "What does the README say?", workdir, home=home)
        assert first.returncode == 0, first.describe()
        [thread] = [e["thread_id"] for e in first.parsed if e.get("type") == "thread.started"]
        second = run_codex(base, MODELS["codex"], "Read it again.", workdir, home=home, resume=thread)
        assert second.returncode == 0, second.describe()
        _check(gateway, session, "sk-codex-local", history, model)


def test_claude_code_two_rollouts_follow_the_policy(agents: Path, history: str, tmp_path: Path) -> None:
    for gateway, model in _gateway(MODELS["claude"], history):
        workdir, home = tmp_path / "project", tmp_path / "home"
        workdir.mkdir()
        home.mkdir()
        (workdir / "README.md").write_text(README)
        session = f"claude{secrets.token_hex(4)}"
        base = f"{gateway.base_url}/sessions/{session}"
        first = run_claude(base, MODELS["claude"], "What does the README say?", workdir, home=home)
        assert first.returncode == 0, first.describe()
        result = first.parsed
        assert isinstance(result, dict) and result["num_turns"] == 2, first.describe()  # Read, then the answer
        second = run_claude(base, MODELS["claude"], "Read it again.", workdir, home=home, resume=result["session_id"])
        assert second.returncode == 0, second.describe()
        body = _check(gateway, session, "sk-ant-local", history, model)
        reasons = [t["finish_reason"] for t in body["turns"]]
        # The first rollout reads, then answers (num_turns above). Whether the second reads again is
        # the tiny model's answer to "Read it again." after a first rollout whose thinking the
        # template drops (under template) or keeps: builds on different machines differ there (the
        # float kernels: tests/unit/test_model_digests.py), as pi's and Codex's second rollouts are
        # not asserted either. It ends in an answer, and the chains above hold either way.
        assert reasons[:2] == ["tool_calls", "stop"] and reasons[2:] in (["stop"], ["tool_calls", "stop"]), reasons


def test_openclaw_tool_loop_with_thinking(agents: Path, tmp_path: Path) -> None:
    """OpenClaw completes a tool loop against a thinking model; each request is its own root.

    OpenClaw drops the thinking, and it moves its internal-context user message to the end of
    every request, so no request continues the previous one: one root per request, exactly as
    with ``tiny-agent`` (``test_agents_e2e.py``). The thinking adds none: no root gives it as the
    cause. Run under ``keep`` only, the policy that would chain them if anything could (``template``
    gives the same count: one root per request).
    """
    history = "keep"
    for gateway, model in _gateway(MODELS["pi"], history):
        session = f"claw{secrets.token_hex(4)}"
        workspace = openclaw_workspace(tmp_path)
        workspace.mkdir(parents=True, exist_ok=True)
        (workspace / "README.md").write_text(README)
        base = f"{gateway.base_url}/sessions/{session}"
        run = run_openclaw(base, MODELS["pi"], "What does the README say?", tmp_path, agent_timeout=20, timeout=180)
        assert run.returncode == 0 or "timed out" in run.stdout, run.describe()
        response = httpx.get(f"{gateway.base_url}/sessions/{session}", headers={"x-api-key": "sk-local"}, timeout=30)
        body = response.json()
        turns = body["turns"]
        # Whether tiny-reasoning calls ``read`` on OpenClaw's prompt (38k tokens of system prompt, its
        # context message moved to the end) is the tiny model's answer to a shape it was not trained on:
        # one build answered "Done" at once (issue 43), another called it. The loop, when it happens,
        # is checked; the recording properties below hold either way. tiny-agent's OpenClaw loop is
        # test_agents_e2e.py's.
        if turns and turns[0]["finish_reason"] == "tool_calls":
            assert "read" in run.tools_used and len(turns) >= 2, run.describe()  # OpenClaw executed the call
        assert turns, run.describe()
        # The turn OpenClaw's time limit cut off (if any) has no finish_reason; the others thought.
        assert all(t["reasoning_tokens"] > 0 for t in turns if t["finish_reason"] is not None)
        assert len(body["chains"]) == len(turns) and all(t["parent_id"] is None for t in turns)
        assert not any("reasoning_history" in (t["fallback_reason"] or "") for t in turns), [
            t["fallback_reason"] for t in turns
        ]
        reference = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        for chain in body["chains"]:
            assert_chain_logprobs(reference, chain["token_ids"], chain["mask"], chain["logprobs"], atol=5e-4)
