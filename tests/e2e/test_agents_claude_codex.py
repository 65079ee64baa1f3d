"""Claude Code (Messages API) and Codex (Responses API), real agents from npm, through the gateway.

The gateway serves the untrained tiny model on the scripted engine (as ``tiny-agent-claude`` and
``tiny-agent-codex``, the names the agents are configured for): after a user message it calls the
agent's file-reading tool (Claude Code's ``Read``, Codex's shell tool ``exec_command`` with
``cat README.md``), after a tool result it answers "Done: I read the file.", each token with the
model's real logprob. Each agent runs non-interactively on 127.0.0.1 against a session-scoped base
URL: a first run where it executes the tool the model called and gets that answer, then a second
run that resumes the same conversation. The session read back holds every turn; each chain is
token-exact (assistant spans are the emitted ids, and a forward pass of the same untrained model
over the chain reproduces the recorded logprobs), and the resumed run continues the first run's
chain.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from stream_gateway.engines import build_engine
from stream_gateway.models import AGENT_AFTER_TOOL

from ..support.agents import ensure_agents_installed, run_claude, run_codex
from ..support.fidelity import assert_chain_logprobs
from ..support.servers import RunningGateway, run_gateway, scripted_settings

pytestmark = pytest.mark.timeout(900)  # the first test may install the agents


@pytest.fixture(scope="module")
def agents() -> Path:
    return ensure_agents_installed()


def _gateway(model: Path, name: str) -> Iterator[RunningGateway]:
    settings = scripted_settings(model, name)
    with run_gateway(build_engine(settings), settings) as running:
        yield running


@pytest.fixture(scope="module")
def claude_gateway(agent_model_path: Path) -> Iterator[RunningGateway]:
    yield from _gateway(agent_model_path, "tiny-agent-claude")


@pytest.fixture(scope="module")
def codex_gateway(agent_model_path: Path) -> Iterator[RunningGateway]:
    yield from _gateway(agent_model_path, "tiny-agent-codex")


def _session(gateway: RunningGateway, session_id: str, key: str) -> dict[str, Any]:
    response = httpx.get(f"{gateway.base_url}/sessions/{session_id}", headers={"x-api-key": key}, timeout=30)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def _assert_token_exact(body: dict[str, Any], model_path: Path) -> None:
    reference = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    turns = {t["turn_id"]: t for t in body["turns"]}
    for chain in body["chains"]:
        for turn_id in chain["turn_ids"]:
            turn = turns[turn_id]
            start = len(turn["prompt_ids"])
            end = start + len(turn["output_ids"])
            assert chain["token_ids"][start:end] == turn["output_ids"]
            assert chain["logprobs"][start:end] == turn["logprobs"]
        assert_chain_logprobs(reference, chain["token_ids"], chain["mask"], chain["logprobs"], atol=5e-4)


def test_claude_code_reads_a_file_and_resumes_in_one_token_exact_chain(
    agents: Path, claude_gateway: RunningGateway, agent_model_path: Path, tmp_path: Path
) -> None:
    workdir, home = tmp_path / "project", tmp_path / "home"
    workdir.mkdir()
    home.mkdir()
    (workdir / "README.md").write_text("The secret word is lighthouse.\n")
    session = f"claude{secrets.token_hex(4)}"
    base = f"{claude_gateway.base_url}/sessions/{session}"
    first = run_claude(base, "tiny-agent-claude", "What does the README say?", workdir, home=home)
    assert first.returncode == 0, first.describe()
    result = first.parsed
    assert isinstance(result, dict) and result["subtype"] == "success", first.describe()
    # Two model calls: Read (executed by Claude Code, not denied), then the answer.
    assert result["num_turns"] == 2 and result["permission_denials"] == [], first.describe()
    assert result["result"] == AGENT_AFTER_TOOL
    second = run_claude(base, "tiny-agent-claude", "Read it again.", workdir, home=home, resume=result["session_id"])
    assert second.returncode == 0 and second.parsed["result"] == AGENT_AFTER_TOOL, second.describe()

    body = _session(claude_gateway, session, "sk-ant-local")
    turns = body["turns"]
    assert [t["finish_reason"] for t in turns] == ["tool_calls", "stop", "tool_calls", "stop"]
    calls = [t["message"]["tool_calls"][0]["function"] for t in turns if t["finish_reason"] == "tool_calls"]
    assert calls == [{"name": "Read", "arguments": '{"file_path":"README.md"}'}] * 2
    # The tool result Claude Code sent back holds the file (cat -n form): it really read it.
    tokenizer = AutoTokenizer.from_pretrained(agent_model_path)
    assert "1\tThe secret word is lighthouse." in tokenizer.decode(turns[1]["prompt_ids"][-200:])
    [chain] = body["chains"]  # both runs, four turns: every echo recognised, one chain
    assert chain["turn_ids"] == [t["turn_id"] for t in turns]
    assert all(t["reused_prompt_tokens"] > 0 for t in turns[1:])
    _assert_token_exact(body, agent_model_path)


def test_codex_runs_a_command_and_resumes_in_one_token_exact_chain(
    agents: Path, codex_gateway: RunningGateway, agent_model_path: Path, tmp_path: Path
) -> None:
    workdir, home = tmp_path / "project", tmp_path / "home"
    workdir.mkdir()
    home.mkdir()
    (workdir / "README.md").write_text("The secret word is lighthouse.\n")
    session = f"codex{secrets.token_hex(4)}"
    base = f"{codex_gateway.base_url}/sessions/{session}"
    first = run_codex(base, "tiny-agent-codex", "What does the README say?", workdir, home=home)
    assert first.returncode == 0, first.describe()
    [command] = first.tools_used  # the one call, as Codex ran it
    assert "cat README.md" in command, first.describe()
    messages = [e["item"]["text"] for e in first.parsed if e.get("type") == "item.completed"
                and e["item"].get("type") == "agent_message"]  # fmt: skip
    assert messages == [AGENT_AFTER_TOOL], first.describe()
    outputs = [e["item"].get("aggregated_output", "") for e in first.parsed if e.get("type") == "item.completed"
               and e["item"].get("type") == "command_execution"]  # fmt: skip
    assert any("lighthouse" in output for output in outputs), first.describe()
    [thread] = [e["thread_id"] for e in first.parsed if e.get("type") == "thread.started"]
    second = run_codex(base, "tiny-agent-codex", "Read it again.", workdir, home=home, resume=thread)
    assert second.returncode == 0, second.describe()

    body = _session(codex_gateway, session, "sk-codex-local")
    turns = body["turns"]
    # Each run: the command, then the answer; the resumed run goes on from there.
    assert [t["finish_reason"] for t in turns] == ["tool_calls", "stop", "tool_calls", "stop"]
    calls = [t["message"]["tool_calls"][0]["function"] for t in turns if t["finish_reason"] == "tool_calls"]
    assert calls == [{"name": "exec_command", "arguments": '{"cmd":"cat README.md"}'}] * 2
    [chain] = body["chains"]  # the resumed run continued the first run's chain
    assert chain["turn_ids"] == [t["turn_id"] for t in turns]
    assert all(t["reused_prompt_tokens"] > 0 for t in turns[1:])
    _assert_token_exact(body, agent_model_path)
