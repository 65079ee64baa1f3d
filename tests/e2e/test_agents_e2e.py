"""Real agents from npm run a tool loop through the gateway; the recorded chains are token-exact.

The gateway serves the untrained tiny model as ``tiny-agent`` on the scripted engine: after a user
message it calls ``read`` on ``README.md``, after a tool result it answers "Done: I read the file."
(engines/_script.py's default script), each token with the model's real logprob. So the agents
really execute a tool the model called. Each agent runs non-interactively on 127.0.0.1 with a
session-scoped base URL, then the test reads the session back and checks every chain: assistant
spans are the emitted ids, and a forward pass of the same untrained model over the chain's tokens
reproduces the recorded logprobs.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from stream_gateway.engines import build_engine
from stream_gateway.models import AGENT_AFTER_TOOL, AGENT_TOOL_CALL

from ..support.agents import ensure_agents_installed, openclaw_workspace, run_openclaw, run_pi
from ..support.fidelity import assert_chain_logprobs
from ..support.servers import ANSWER_AFTER_ANY_TOOL_RESULT, RunningGateway, run_gateway, script_file, scripted_settings

pytestmark = pytest.mark.timeout(900)  # the first test may install the agents (about a minute)


@pytest.fixture(scope="module")
def agents() -> Iterator[Path]:
    yield ensure_agents_installed()


@pytest.fixture(scope="module")
def reference(agent_model_path: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(agent_model_path, dtype=torch.float32).eval()


def _session(gateway: RunningGateway, session_id: str) -> dict[str, Any]:
    r = httpx.get(f"{gateway.base_url}/sessions/{session_id}", headers={"authorization": "Bearer sk-local"}, timeout=30)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def _assert_token_exact(body: dict[str, Any], reference: Any) -> None:
    turns = {t["turn_id"]: t for t in body["turns"]}
    for chain in body["chains"]:
        for turn_id in chain["turn_ids"]:  # T1
            turn = turns[turn_id]
            start = len(turn["prompt_ids"])
            end = start + len(turn["output_ids"])
            assert chain["token_ids"][start:end] == turn["output_ids"]
            assert chain["logprobs"][start:end] == turn["logprobs"]
            assert set(chain["mask"][start:end]) <= {1}
        assert_chain_logprobs(reference, chain["token_ids"], chain["mask"], chain["logprobs"], atol=5e-4)


def test_pi_tool_loop_and_follow_up_form_one_token_exact_chain(
    agents: Path, agent_gateway: RunningGateway, agent_model_path: Path, reference: Any, tmp_path: Path
) -> None:
    session = f"pi{secrets.token_hex(4)}"
    base = f"{agent_gateway.base_url}/sessions/{session}"
    (tmp_path / "README.md").write_text("The secret word is lighthouse.\n")
    history = tmp_path / "pi-session"
    first = run_pi(base, "tiny-agent", "What does the README say?", tmp_path, continue_session_dir=history)
    assert first.returncode == 0, first.describe()
    assert "read" in first.tools_used, first.describe()
    second = run_pi(base, "tiny-agent", "Read it once more.", tmp_path, continue_session_dir=history)
    assert second.returncode == 0, second.describe()
    assert "read" in second.tools_used, second.describe()

    body = _session(agent_gateway, session)
    finishes = [t["finish_reason"] for t in body["turns"]]
    assert finishes == ["tool_calls", "stop", "tool_calls", "stop"], finishes
    # pi echoes its history byte for byte: both runs, all four turns, are one chain.
    assert [c["turn_ids"] for c in body["chains"]] == [[t["turn_id"] for t in body["turns"]]]
    assert all(t["reused_prompt_tokens"] > 0 for t in body["turns"][1:])
    _assert_token_exact(body, reference)
    tokenizer = AutoTokenizer.from_pretrained(agent_model_path)
    outputs = [tokenizer.decode(t["output_ids"], skip_special_tokens=True) for t in body["turns"]]
    assert outputs == [AGENT_TOOL_CALL, AGENT_AFTER_TOOL] * 2, outputs


def test_openclaw_tool_loop_is_recorded_token_exactly(
    agents: Path, agent_model_path: Path, reference: Any, tmp_path: Path
) -> None:
    """OpenClaw executes the model's ``read`` call and sends the result back; every turn is exact.

    OpenClaw moves its internal-context user message behind the tool result, so the default script
    (which answers when a tool result is last) would call ``read`` until OpenClaw's time limit. This
    gateway's script answers once a tool result is anywhere in the prompt: one call, one answer.
    """
    settings = scripted_settings(
        agent_model_path, script=script_file(tmp_path / "script.json", ANSWER_AFTER_ANY_TOOL_RESULT)
    )
    session = f"claw{secrets.token_hex(4)}"
    workspace = openclaw_workspace(tmp_path)
    workspace.mkdir(parents=True, exist_ok=True)
    (workspace / "README.md").write_text("The secret word is lighthouse.\n")
    with run_gateway(build_engine(settings), settings) as gateway:
        base = f"{gateway.base_url}/sessions/{session}"
        run = run_openclaw(base, "tiny-agent", "What does the README say?", tmp_path, agent_timeout=60, timeout=180)
        assert run.returncode == 0, run.describe()
        body = _session(gateway, session)
    turns = body["turns"]
    assert [t["finish_reason"] for t in turns] == ["tool_calls", "stop"], run.describe()
    assert [c["function"] for c in turns[0]["message"]["tool_calls"]] == [
        {"name": "read", "arguments": '{"path":"README.md"}'}
    ]
    tokenizer = AutoTokenizer.from_pretrained(agent_model_path)
    assert tokenizer.decode(turns[1]["output_ids"], skip_special_tokens=True) == AGENT_AFTER_TOOL
    # That OpenClaw really executed the model's call is read from what the gateway received next
    # (the README's text in the following request's tool result), not from OpenClaw's receipt.
    assert "lighthouse" not in tokenizer.decode(turns[0]["prompt_ids"])
    follow_up = tokenizer.decode(turns[1]["prompt_ids"])
    responses = re.findall(r"<tool_response>(.*?)</tool_response>", follow_up, flags=re.DOTALL)
    assert any("lighthouse" in r for r in responses), follow_up[-2000:]
    # OpenClaw moves its internal-context message to the end of every request, so no request's
    # messages start with an earlier turn's conversation: every turn is a root of its own chain.
    assert len(body["chains"]) == len(turns)
    assert all(t["parent_id"] is None for t in turns)
    _assert_token_exact(body, reference)
