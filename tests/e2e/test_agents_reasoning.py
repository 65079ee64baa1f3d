"""Real agents against a thinking model: rollouts -> trajectories equals the history policy's number.

THUDM/slime#2288 saw 8 Claude Code rollouts become 64 training samples because each echo of the
thinking forked the prompt. Here each agent runs twice (a run, then a resumed one: two user
messages) against a thinking model: the untrained ``tiny-reasoning-untrained`` on the scripted
engine, served under the names the agents are configured for (``tiny-reasoning``,
``tiny-reasoning-claude``, ``tiny-reasoning-codex``). Every answer thinks first, then calls the
agent's reading tool after a user message, or says "Done: I read the file." after a tool result.
Under ``--reasoning-history keep`` the session is one chain, under ``template`` one root per user
message, whatever the agent did with the thinking it was streamed. The chains are token-exact (a
forward pass of the same untrained model reproduces them). OpenClaw moves its internal-context
message to the end of every request, so each of its turns is a root with or without thinking: its
test checks that the thinking adds no root of its own.
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

from stream_gateway.engines import build_engine

from ..support.agents import ensure_agents_installed, openclaw_workspace, run_claude, run_codex, run_openclaw, run_pi
from ..support.fidelity import assert_chain_logprobs
from ..support.servers import ANSWER_AFTER_ANY_TOOL_RESULT, RunningGateway, run_gateway, script_file, scripted_settings

pytestmark = pytest.mark.timeout(900)  # the first test may install the agents

README = "The secret word is lighthouse.\n"
# The names served to each agent (its configuration names one); all are tiny-reasoning-untrained.
MODELS = {"pi": "tiny-reasoning", "claude": "tiny-reasoning-claude", "codex": "tiny-reasoning-codex"}
# Two rollouts: each calls the reading tool, then answers after its result (each after a thought).
TWO_ROLLOUTS = ["tool_calls", "stop", "tool_calls", "stop"]


@pytest.fixture(scope="module")
def agents() -> Path:
    return ensure_agents_installed()


@pytest.fixture(scope="module", params=["keep", "template"])
def history(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _gateway(model: Path, name: str, history: str, **options: Any) -> Iterator[RunningGateway]:
    settings = scripted_settings(model, name, reasoning_history=history, **options)
    with run_gateway(build_engine(settings), settings) as running:
        yield running


def _check(gateway: RunningGateway, session: str, key: str, history: str, model: Path) -> dict[str, Any]:
    response = httpx.get(f"{gateway.base_url}/sessions/{session}", headers={"x-api-key": key}, timeout=30)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    turns = body["turns"]
    assert [t["finish_reason"] for t in turns] == TWO_ROLLOUTS, [t["finish_reason"] for t in turns]
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


def test_pi_two_rollouts_follow_the_policy(
    agents: Path, history: str, reasoning_model_path: Path, tmp_path: Path
) -> None:
    for gateway in _gateway(reasoning_model_path, MODELS["pi"], history):
        session = f"pi{secrets.token_hex(4)}"
        base = f"{gateway.base_url}/sessions/{session}"
        (tmp_path / "README.md").write_text(README)
        saved = tmp_path / "pi-session"
        first = run_pi(base, MODELS["pi"], "What does the README say?", tmp_path, continue_session_dir=saved)
        assert first.returncode == 0 and first.tools_used == ["read"], first.describe()
        second = run_pi(base, MODELS["pi"], "Read it once more.", tmp_path, continue_session_dir=saved)
        assert second.returncode == 0 and second.tools_used == ["read"], second.describe()
        _check(gateway, session, "sk-local", history, reasoning_model_path)


def test_codex_two_rollouts_follow_the_policy(
    agents: Path, history: str, reasoning_model_path: Path, tmp_path: Path
) -> None:
    for gateway in _gateway(reasoning_model_path, MODELS["codex"], history):
        workdir, home = tmp_path / "project", tmp_path / "home"
        workdir.mkdir()
        home.mkdir()
        (workdir / "README.md").write_text(README)
        session = f"codex{secrets.token_hex(4)}"
        base = f"{gateway.base_url}/sessions/{session}"
        first = run_codex(base, MODELS["codex"], "What does the README say?", workdir, home=home)
        assert first.returncode == 0, first.describe()
        [command] = first.tools_used  # the one call, as Codex ran it
        assert "cat README.md" in command, first.describe()
        [thread] = [e["thread_id"] for e in first.parsed if e.get("type") == "thread.started"]
        second = run_codex(base, MODELS["codex"], "Read it again.", workdir, home=home, resume=thread)
        assert second.returncode == 0, second.describe()
        _check(gateway, session, "sk-codex-local", history, reasoning_model_path)


def test_claude_code_two_rollouts_follow_the_policy(
    agents: Path, history: str, reasoning_model_path: Path, tmp_path: Path
) -> None:
    for gateway in _gateway(reasoning_model_path, MODELS["claude"], history):
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
        assert second.returncode == 0 and second.parsed["num_turns"] == 2, second.describe()
        _check(gateway, session, "sk-ant-local", history, reasoning_model_path)


def test_openclaw_tool_loop_with_thinking(agents: Path, reasoning_model_path: Path, tmp_path: Path) -> None:
    """OpenClaw completes a tool loop against a thinking model; each request is its own root.

    OpenClaw drops the thinking, and it moves its internal-context user message to the end of
    every request, so no request continues the previous one: one root per request, exactly as
    with ``tiny-agent`` (``test_agents_e2e.py``). The thinking adds none: no root gives it as the
    cause. Run under ``keep`` only, the policy that would chain them if anything could (``template``
    gives the same count: one root per request). The script answers once a tool result is anywhere
    in the prompt (OpenClaw's context, not the result, comes last): one call, then the answer.
    """
    script = script_file(tmp_path / "script.json", ANSWER_AFTER_ANY_TOOL_RESULT)
    for gateway in _gateway(reasoning_model_path, MODELS["pi"], "keep", script=script):
        session = f"claw{secrets.token_hex(4)}"
        workspace = openclaw_workspace(tmp_path)
        workspace.mkdir(parents=True, exist_ok=True)
        (workspace / "README.md").write_text(README)
        base = f"{gateway.base_url}/sessions/{session}"
        run = run_openclaw(base, MODELS["pi"], "What does the README say?", tmp_path, agent_timeout=60, timeout=180)
        assert run.returncode == 0 and "read" in run.tools_used, run.describe()
        response = httpx.get(f"{gateway.base_url}/sessions/{session}", headers={"x-api-key": "sk-local"}, timeout=30)
        body = response.json()
        turns = body["turns"]
        assert [t["finish_reason"] for t in turns] == ["tool_calls", "stop"], run.describe()
        assert all(t["reasoning_tokens"] > 0 for t in turns)
        assert len(body["chains"]) == len(turns) and all(t["parent_id"] is None for t in turns)
        assert not any("reasoning_history" in (t["fallback_reason"] or "") for t in turns), [
            t["fallback_reason"] for t in turns
        ]
        reference = AutoModelForCausalLM.from_pretrained(reasoning_model_path, dtype=torch.float32).eval()
        for chain in body["chains"]:
            assert_chain_logprobs(reference, chain["token_ids"], chain["mask"], chain["logprobs"], atol=5e-4)
