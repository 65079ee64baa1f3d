"""verl batches from real gateway traffic, checked with verl 0.9.1's own code.

The traffic is real: two real gateways driven by the official openai client in streamed multi-turn
sessions, sampled at temperatures 1.0 and 0.7 with different seeds. One serves ``tiny-agent``'s
answers on the scripted engine (the untrained ``tiny`` told what to say, its logprobs a real forward
pass): a tool loop that calls ``read`` and continues after the tool result, and a chat continued by
a second user message. The other samples freely from the untrained ``tiny`` on the transformers
engine. Each session's chain (``GET /sessions/{id}``) becomes a trajectory
(:mod:`tests.support.trajectories`), and the test assigns the rewards.

What is checked against verl itself: ``DataProto`` construction and its consistency checks, its
batch operations, the padded tensors that verl's own agent-loop postprocessing builds from the
same rows, ``compute_grpo_outcome_advantage``, the ``vanilla`` policy loss, verl's
padded-to-no-padding conversion and its v1 per-sample layout. And the fidelity test: a forward
pass of the same model over the batch reproduces ``rollout_log_probs`` wherever
``response_mask`` is 1.
"""

from __future__ import annotations

import asyncio
import pickle
import secrets
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from openai import OpenAI
from transformers import AutoModelForCausalLM, AutoTokenizer

# verl is part of the test environment (scripts/install.sh installs the `verl` extra): no skip.
from verl.protocol import DataProto
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage, get_policy_loss_fn
from verl.utils.model import compute_position_id_with_mask
from verl.workers.config import ActorConfig
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

from consumers.trajectory import TRAJECTORY_SCHEMA_VERSION, ExpertRoutes, Trajectory, TurnSummary
from consumers.verl_batch import PaddedBatch, group_uid, padded_batch, to_data_proto, to_jagged_tensordict
from stream_gateway.models import AGENT_AFTER_TOOL, AGENT_TOOL_CALL, AGENT_WITHOUT_TOOLS

from ..support.agent_loop import READ_TOOL, drive_session
from ..support.servers import RunningGateway
from ..support.trajectories import trajectories_from_session

# Importing verl's agent loop imports ray.experimental.state, which ray 2.60 deprecates with a
# DeprecationWarning at import time; only the tests that import the agent loop ignore it.
RAY_STATE_API_WARNING = "ignore:Ray state API is no longer experimental:DeprecationWarning"

TOOLS = [READ_TOOL]
ATOL = 2e-4  # as tests/support/fidelity.py: fp32 CPU, the engine's batch vs this one-off forward pass


@dataclass(frozen=True)
class Traffic:
    """Trajectories from real sessions, the temperature each was sampled at, and the models."""

    trajectories: list[Trajectory]
    temperatures: dict[str, float]  # by trajectory id
    model_paths: dict[str, Path]  # by served model name (Trajectory.model)

    @property
    def uids(self) -> list[str]:
        return [group_uid(t, "metadata:group") for t in self.trajectories]

    def batch(self, *, slack: int = 3) -> PaddedBatch:
        """A padded batch a little wider than the longest prompt and response."""
        return padded_batch(
            self.trajectories,
            self.uids,
            prompt_length=max(t.prompt_length for t in self.trajectories) + slack,
            response_length=max(t.response_length for t in self.trajectories) + slack,
            pad_token_id=0,
        )


@dataclass(frozen=True)
class _Plan:
    """One session to run: where, what, how it is sampled, and the reward the test gives it."""

    model: str
    group: str
    temperature: float
    seed: int
    reward: float

    @property
    def messages(self) -> list[dict[str, Any]]:
        if self.group == "readme":
            return [
                {"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": "What does the README say?"},
            ]
        if self.group == "hello":
            return [{"role": "user", "content": "Say hello."}]
        return [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me a story."}]

    @property
    def follow_ups(self) -> list[str]:
        return {"readme": [], "hello": ["Say hello again."]}.get(self.group, ["More.", "Again."])


def _session(gateway: RunningGateway, workdir: Path, plan: _Plan) -> dict[str, Any]:
    """Run one streamed session to its end; the gateway's ``GET /sessions/{id}`` body.

    A tool call is executed and its result sent back (the assistant message echoed exactly);
    otherwise the next follow-up user message continues the conversation, until none is left.
    """
    session = f"verl{secrets.token_hex(4)}"
    with OpenAI(
        base_url=f"{gateway.base_url}/sessions/{session}/v1", api_key="sk-verl", timeout=120, max_retries=0
    ) as client:
        drive_session(
            client,
            plan.model,
            plan.messages,
            follow_ups=plan.follow_ups,
            workdir=workdir,
            tools=TOOLS if plan.group == "readme" else None,
            temperature=plan.temperature,
            top_p=1.0,
            seed=plan.seed,
            max_tokens=24 if plan.model == "tiny" else 64,
        )
    response = httpx.get(
        f"{gateway.base_url}/sessions/{session}", headers={"authorization": "Bearer sk-verl"}, timeout=10
    )
    response.raise_for_status()
    body: dict[str, Any] = response.json()
    return body


PLANS = [
    _Plan("tiny-agent", "readme", 1.0, 101, 1.0),
    _Plan("tiny-agent", "readme", 1.0, 102, -1.0),
    _Plan("tiny-agent", "readme", 1.0, 103, 1.0),
    _Plan("tiny-agent", "hello", 0.7, 201, -1.0),
    _Plan("tiny-agent", "hello", 0.7, 202, 1.0),
    _Plan("tiny", "chat", 1.0, 301, 1.0),
    _Plan("tiny", "chat", 1.0, 302, -1.0),
    _Plan("tiny", "chat", 0.7, 303, -1.0),
]


@pytest.fixture(scope="module")
def traffic(
    agent_gateway: RunningGateway,
    gateway: RunningGateway,
    agent_model_path: Path,
    tiny_model_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Traffic:
    """Eight real sessions in three groups.

    ``tiny-agent`` (the scripted engine on the untrained ``tiny``): three tool loops (call ``read``,
    get the result, answer) at T=1.0, and two two-turn chats at T=0.7; the script fixes the ids, the
    model's distribution at each step (untrained, so far from certain) gives their logprobs.
    ``tiny`` (transformers, untrained, high entropy) adds three three-turn chats, at T=1.0 and 0.7,
    whose truncated replies do not survive re-tokenization, so only the reused sampled ids can
    reproduce them.
    """
    workdir = tmp_path_factory.mktemp("verl_workdir")
    (workdir / "README.md").write_text("The secret word is lighthouse.\n")
    gateways = {"tiny-agent": agent_gateway, "tiny": gateway}
    trajectories: list[Trajectory] = []
    temperatures: dict[str, float] = {}
    for plan in PLANS:
        body = _session(gateways[plan.model], workdir, plan)
        [trajectory] = trajectories_from_session(
            body, plan.reward, tenant="sk-verl", model=plan.model, metadata={"group": plan.group}
        )
        trajectories.append(trajectory)
        temperatures[trajectory.trajectory_id] = plan.temperature
    return Traffic(trajectories, temperatures, {"tiny-agent": agent_model_path, "tiny": tiny_model_path})


def test_traffic_is_multi_turn_with_tool_results(traffic: Traffic) -> None:
    """The batch below really holds multi-turn rows, with unsampled (tool/user) ids between turns."""
    assert [t.metadata["group"] for t in traffic.trajectories] == [p.group for p in PLANS]
    for t in traffic.trajectories:
        assert t.num_turns >= 2, t.turns
        response_mask = t.loss_mask[t.prompt_length :]
        # a sampled span, then inserted ids (mask 0), then sampled again
        assert response_mask[0] == 1 and response_mask[-1] == 1 and 0 in response_mask
    assert len({t.prompt_length for t in traffic.trajectories}) >= 2, "rows must differ in prompt length"


def test_tiny_agent_rows_hold_the_scripted_answers(traffic: Traffic, agent_model_path: Path) -> None:
    """The scripted rows sampled exactly tiny-agent's answers: a call to ``read``, then done; hello twice."""
    tokenizer = AutoTokenizer.from_pretrained(agent_model_path)
    expected = {
        "readme": [("tool_calls", AGENT_TOOL_CALL), ("stop", AGENT_AFTER_TOOL)],
        "hello": [("stop", AGENT_WITHOUT_TOOLS)] * 2,
    }
    rows = [t for t in traffic.trajectories if t.model == "tiny-agent"]
    assert [t.metadata["group"] for t in rows] == ["readme"] * 3 + ["hello"] * 2
    for t in rows:
        said = [(s.finish_reason, tokenizer.decode(t.token_ids[s.start : s.start + s.length])) for s in t.turns]
        assert said == [(reason, text + "<|im_end|>") for reason, text in expected[t.metadata["group"]]], said


def test_padded_batch_is_accepted_by_data_proto(traffic: Traffic) -> None:
    batch = traffic.batch()
    size, (p, r) = len(traffic.trajectories), (batch.tensors["prompts"].shape[1], batch.tensors["responses"].shape[1])
    proto = to_data_proto(batch)
    assert isinstance(proto, DataProto)
    proto.check_consistency()
    assert len(proto) == len(batch) == size and tuple(proto.batch.batch_size) == (size,)
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in proto.batch.items()}
    assert shapes == {
        "prompts": ((size, p), torch.int64),
        "responses": ((size, r), torch.int64),
        "response_mask": ((size, r), torch.int64),
        "reasoning_mask": ((size, r), torch.int64),
        "input_ids": ((size, p + r), torch.int64),
        "attention_mask": ((size, p + r), torch.int64),
        "position_ids": ((size, p + r), torch.int64),
        "rollout_log_probs": ((size, r), torch.float32),
        "rm_scores": ((size, r), torch.float32),
    }
    groups = ["readme"] * 3 + ["hello"] * 2 + ["chat"] * 3
    assert list(proto.non_tensor_batch["uid"]) == [f"sk-verl/{g}" for g in groups]  # a label is its tenant's name
    assert proto.non_tensor_batch["__num_turns__"].dtype == np.int32
    assert list(proto.non_tensor_batch["__num_turns__"]) == [2 * t.num_turns for t in traffic.trajectories]
    assert all(v.dtype == object for k, v in proto.non_tensor_batch.items() if k != "__num_turns__")
    assert proto.meta_info == {"timing": {}, "reward_extra_keys": []}

    # Every row holds its trajectory's ids, mask and logprobs exactly, where verl expects them.
    tensors = proto.batch
    for i, t in enumerate(traffic.trajectories):
        valid = tensors["attention_mask"][i].bool()
        assert tensors["input_ids"][i][valid].tolist() == t.token_ids
        n = t.response_length
        assert tensors["response_mask"][i, :n].tolist() == t.loss_mask[t.prompt_length :]
        assert tensors["rollout_log_probs"][i, :n].tolist() == torch.tensor(t.logprobs[t.prompt_length :]).tolist()
        assert not tensors["response_mask"][i, n:].any() and not tensors["rollout_log_probs"][i, n:].any()
        assert tensors["rm_scores"][i].nonzero().flatten().tolist() == [n - 1]
        assert tensors["rm_scores"][i, n - 1].item() == t.reward
        assert tensors["reasoning_mask"][i, :n].tolist() == t.reasoning_mask[t.prompt_length :]
    assert not tensors["reasoning_mask"].any()  # tiny models do not think
    assert torch.equal(tensors["position_ids"], compute_position_id_with_mask(tensors["attention_mask"]))
    # Each response token's policy version, -1 where nothing was sampled (prompts, tool results, padding).
    versions = np.stack(list(proto.non_tensor_batch["policy_versions"]))
    assert versions.shape == (size, r) and versions.dtype == np.int64
    for i, t in enumerate(traffic.trajectories):
        sampled = tensors["response_mask"][i].bool().numpy()
        assert (versions[i][~sampled] == -1).all() and (versions[i][sampled] == t.min_policy_version).all()

    # What the trainer does to a batch: concat, repeat, select, chunk, pickle (Ray), TensorDict.
    assert len(DataProto.concat([proto, proto])) == 2 * size
    assert DataProto.concat([proto, proto]).batch["reasoning_mask"].shape == (2 * size, r)
    assert len(proto.repeat(repeat_times=2, interleave=True)) == 2 * size
    assert list(proto.select_idxs([0, 3]).non_tensor_batch["uid"]) == ["sk-verl/readme", "sk-verl/hello"]
    assert [len(c) for c in proto.chunk(4)] == [2] * 4
    restored = pickle.loads(pickle.dumps(proto))
    assert torch.equal(restored.batch["input_ids"], proto.batch["input_ids"])
    assert set(proto.to_tensordict().keys()) >= {"input_ids", "uid", "__num_turns__", "timing"}


def test_per_token_policy_versions_reach_both_layouts_and_the_parquet() -> None:
    """A turn sampled across two weight updates: its three spans, token by token, in every output."""
    from consumers.parquet import decode_batch, encode_batch

    spans = [(4, 0), (5, 2), (6, 3)]
    turns = [
        TurnSummary(turn_id="a", start=3, length=2, finish_reason="tool_calls", policy_version=3),
        TurnSummary(turn_id="b", start=7, length=5, finish_reason="stop", policy_version=4, policy_versions=spans),
    ]
    tokens = list(range(10, 22))
    mask = [0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 1, 1]
    trajectory = Trajectory(
        trajectory_id="tr1", session_id="s", tenant="t", model="m", token_ids=tokens, loss_mask=mask,
        logprobs=[-0.5 * m for m in mask], prompt_length=3, turns=turns, num_turns=2, min_policy_version=3,
        max_policy_version=6, reward=1.0, emitted_because="closed", started_at=0.0, ended_at=1.0,
    )  # fmt: skip
    expected = [3, 3, -1, -1, 4, 4, 5, 6, 6]  # the response: everything after the first prompt
    assert trajectory.token_policy_versions() == [-1, -1, -1, *expected]
    batch = padded_batch([trajectory], ["u"], prompt_length=4, response_length=12, pad_token_id=0)
    proto = to_data_proto(batch)
    assert proto.non_tensor_batch["policy_versions"][0].tolist() == [*expected, -1, -1, -1]
    jagged = to_jagged_tensordict([trajectory], ["u"])
    assert jagged["policy_versions"][0].tolist() == expected
    data = encode_batch([trajectory], ["u"], batch_id="b", prompt_length=4, response_length=12)
    assert decode_batch(data) == ([trajectory], ["u"])
    import pyarrow.parquet as pq

    column = pq.read_table(__import__("io").BytesIO(data)).column("token_policy_versions").to_pylist()
    assert column == [[-1, -1, -1, *expected]]


def _thinking_trajectory() -> Trajectory:
    """Two turns of a reasoning model: a, thinking 3 of 4 ids then answering; b, cut off while thinking."""
    turns = [
        TurnSummary(turn_id="a", start=3, length=4, finish_reason="tool_calls", policy_version=3, reasoning_tokens=3,
                    answer_start=3),
        TurnSummary(turn_id="b", start=9, length=3, finish_reason="length", policy_version=3, reasoning_tokens=3,
                    answer_start=None),
    ]  # fmt: skip
    mask = [0, 0, 0, 1, 1, 1, 1, 0, 0, 1, 1, 1]
    return Trajectory(
        trajectory_id="trthink", session_id="s", tenant="t", model="m", token_ids=list(range(10, 22)), loss_mask=mask,
        logprobs=[-0.5 * m for m in mask], reasoning_mask=[0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 1], prompt_length=3,
        turns=turns, num_turns=2, min_policy_version=3, max_policy_version=3, reward=1.0, emitted_because="closed",
        started_at=0.0, ended_at=1.0,
    )  # fmt: skip


def test_thinking_reaches_both_layouts_and_the_parquet() -> None:
    """``reasoning_mask`` over the response, aligned with ``response_mask``; thinking stays in the loss mask."""
    import io
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from consumers.parquet import decode_batch, encode_batch

    trajectory, plain = _thinking_trajectory(), _trajectory([5, 6], [8, 9, 10], [1, 0, 1])
    expected = [1, 1, 1, 0, 0, 0, 1, 1, 1]  # the response: everything after the first prompt
    batch = padded_batch([trajectory, plain], ["u", "v"], prompt_length=4, response_length=11, pad_token_id=0)
    proto = to_data_proto(batch)
    reasoning, response_mask = proto.batch["reasoning_mask"], proto.batch["response_mask"]
    assert reasoning.dtype == torch.int64 and reasoning.shape == response_mask.shape == (2, 11)
    assert reasoning.tolist() == [[*expected, 0, 0], [0] * 11]
    assert response_mask.tolist() == [[1, 1, 1, 1, 0, 0, 1, 1, 1, 0, 0], [1, 0, 1, *[0] * 8]]
    # Excluding thinking, as a trainer would: only the answer id of row 0 is left, row 1 is untouched.
    answer_only = response_mask * (1 - reasoning)
    assert answer_only.tolist() == [[0, 0, 0, 1, *[0] * 7], response_mask[1].tolist()]
    assert proto.select_idxs([1, 0]).batch["reasoning_mask"][1].tolist() == reasoning[0].tolist()
    assert proto.chunk(2)[0].batch["reasoning_mask"].tolist() == [reasoning[0].tolist()]

    jagged = to_jagged_tensordict([trajectory, plain], ["u", "v"])
    assert jagged["reasoning_mask"].is_nested and jagged["reasoning_mask"].dtype == torch.int64
    assert [row.tolist() for row in jagged["reasoning_mask"].unbind()] == [expected, [0, 0, 0]]
    assert [row.tolist() for row in jagged["response_mask"].unbind()] == [[1, 1, 1, 1, 0, 0, 1, 1, 1], [1, 0, 1]]

    data = encode_batch([trajectory, plain], ["u", "v"], batch_id="b", prompt_length=4, response_length=11)
    assert decode_batch(data) == ([trajectory, plain], ["u", "v"])
    table = pq.read_table(io.BytesIO(data))
    assert table.schema.field("reasoning_mask").type == pa.list_(pa.int8())
    assert table.column("reasoning_mask").to_pylist() == [[0, 0, 0, *expected], [0] * 5]
    turns = [json.loads(row) for row in table.column("turns").to_pylist()]
    assert [(t["reasoning_tokens"], t["answer_start"]) for t in turns[0]] == [(3, 3), (3, None)]

    # A batch written before thinking (no column, schema 2, turns without the fields) reads as no thinking.
    old_turns = [
        json.dumps([{k: v for k, v in t.items() if k not in ("reasoning_tokens", "answer_start")} for t in row])
        for row in turns
    ]
    old = table.drop_columns(["reasoning_mask"])
    old = old.set_column(old.schema.get_field_index("turns"), "turns", pa.array(old_turns))
    old = old.set_column(old.schema.get_field_index("schema_version"), "schema_version", pa.array([2, 2], pa.int8()))
    sink = io.BytesIO()
    pq.write_table(old, sink)
    [old_thinking, old_plain], uids = decode_batch(sink.getvalue())
    assert uids == ["u", "v"] and old_thinking.schema_version == 2 and old_thinking.reasoning_mask == [0] * 12
    assert [(t.reasoning_tokens, t.answer_start) for t in old_thinking.turns] == [(0, 0), (0, 0)]
    assert old_thinking.loss_mask == trajectory.loss_mask and old_plain.reasoning_mask == plain.reasoning_mask
    old_batch = padded_batch([old_thinking], ["u"], prompt_length=4, response_length=11, pad_token_id=0)
    assert not old_batch.tensors["reasoning_mask"].any()
    assert torch.equal(old_batch.tensors["response_mask"], response_mask[:1])


@pytest.mark.filterwarnings(RAY_STATE_API_WARNING)
def test_padded_batch_equals_verls_own_agent_loop_postprocessing(traffic: Traffic, agent_model_path: Path) -> None:
    """The same rows through ``AgentLoopWorker._agent_loop_postprocess`` and ``_postprocess``.

    A worker object is made without ``__init__`` (which wants a Ray cluster, a rollout server and
    a full trainer config); its postprocessing methods only read the attributes set here.
    """
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput, AgentLoopWorker

    batch = traffic.batch()
    p, r = batch.tensors["prompts"].shape[1], batch.tensors["responses"].shape[1]
    worker = object.__new__(AgentLoopWorker)
    worker.tokenizer = AutoTokenizer.from_pretrained(agent_model_path)
    worker.processor = None
    worker.rollout_config = SimpleNamespace(prompt_length=p, response_length=r)
    worker.reward_loop_worker_handles = None
    worker.distillation_enabled = False
    worker.mm_processor_kwargs = {}

    async def postprocess() -> DataProto:
        outputs = []
        for t in traffic.trajectories:
            cut = t.prompt_length
            output = AgentLoopOutput(
                prompt_ids=t.token_ids[:cut],
                response_ids=t.token_ids[cut:],
                response_mask=t.loss_mask[cut:],
                response_logprobs=t.logprobs[cut:],
                reward_score=t.reward,
                num_turns=2 * t.num_turns,
                metrics=AgentLoopMetrics(),
            )
            outputs.append(await worker._agent_loop_postprocess(output, validate=False, raw_prompt=[]))
        uids = np.array(traffic.uids, dtype=object)
        result: DataProto = worker._postprocess(outputs, input_non_tensor_batch={"uid": uids})
        return result

    verls = asyncio.run(postprocess())
    ours = to_data_proto(batch)
    assert set(verls.batch.keys()) == set(ours.batch.keys()) - {"reasoning_mask"}  # ours alone
    for key in sorted(verls.batch.keys()):
        assert verls.batch[key].dtype == ours.batch[key].dtype, key
        assert torch.equal(verls.batch[key], ours.batch[key]), key
    assert set(verls.non_tensor_batch) - set(ours.non_tensor_batch) == {"raw_prompt"}
    for key in ("uid", "__num_turns__", "multi_modal_inputs"):
        assert verls.non_tensor_batch[key].dtype == ours.non_tensor_batch[key].dtype, key
        assert list(verls.non_tensor_batch[key]) == list(ours.non_tensor_batch[key]), key


def _grpo(proto: DataProto) -> torch.Tensor:
    advantages, returns = compute_grpo_outcome_advantage(
        token_level_rewards=proto.batch["rm_scores"],
        response_mask=proto.batch["response_mask"],
        index=proto.non_tensor_batch["uid"],
    )
    assert torch.equal(advantages, returns)
    result: torch.Tensor = advantages
    return result


def test_grpo_advantages_and_policy_loss(traffic: Traffic) -> None:
    proto = to_data_proto(traffic.batch())
    mask = proto.batch["response_mask"]
    advantages = _grpo(proto)
    assert advantages.shape == mask.shape and not advantages[mask == 0].any()
    # One advantage per row, on every sampled token: (reward - group mean) / (group std + eps).
    per_row = advantages.sum(dim=1) / mask.sum(dim=1)
    assert torch.allclose(advantages, per_row[:, None] * mask)
    rewards = torch.tensor([t.reward for t in traffic.trajectories])
    for group in ("readme", "hello", "chat"):
        rows = torch.tensor([u == f"sk-verl/{group}" for u in proto.non_tensor_batch["uid"]])
        assert rows.sum() >= 2
        assert abs(per_row[rows].sum().item()) < 1e-5, group
        expected = (rewards[rows] - rewards[rows].mean()) / (rewards[rows].std() + 1e-6)
        torch.testing.assert_close(per_row[rows], expected)

    config = ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, rollout_n=1)
    loss_fn = get_policy_loss_fn("vanilla")
    old = proto.batch["rollout_log_probs"]
    # On-policy (log_prob == old): ratio 1, so the token-mean loss is minus the mean advantage.
    loss, metrics = loss_fn(old, old, advantages, mask, loss_agg_mode="token-mean", config=config)
    torch.testing.assert_close(loss, -(advantages * mask).sum() / mask.sum())
    assert metrics["actor/ppo_kl"] == 0.0
    # A slightly moved policy: a finite scalar with gradients on every sampled token.
    log_prob = (old + 0.01 * torch.randn(old.shape, generator=torch.Generator().manual_seed(0))).requires_grad_()
    loss, metrics = loss_fn(old, log_prob, advantages, mask, loss_agg_mode="token-mean", config=config)
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    assert log_prob.grad is not None and torch.isfinite(log_prob.grad).all()
    assert (log_prob.grad[mask == 0] == 0).all() and (log_prob.grad[mask == 1] != 0).all()


def _load(path: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_fidelity_forward_pass_reproduces_rollout_log_probs(traffic: Traffic) -> None:
    """The project's proof of token exactness, end to end, on verl's padded tensors.

    An fp32 forward pass of the same model over ``input_ids``/``attention_mask``/``position_ids``
    gives, at the position before each response token, the logprob the gateway recorded, wherever
    ``response_mask`` is 1. The gateway's logprobs are "processed" (after temperature), so the
    logits are divided by each row's sampling temperature (1.0 or 0.7; top_p was 1). Each served
    model's directory scores the whole batch (for ``tiny-agent``, the untrained ``tiny`` the scripted
    engine ran); its own rows are compared. Then verl's vanilla policy loss on the
    recomputed logprobs back-propagates into the model.
    """
    proto = to_data_proto(traffic.batch())
    tensors = proto.batch
    p, r = tensors["prompts"].shape[1], tensors["responses"].shape[1]
    mask = tensors["response_mask"].bool()
    rollout = tensors["rollout_log_probs"]
    temperature = torch.tensor([traffic.temperatures[t.trajectory_id] for t in traffic.trajectories])
    advantages = _grpo(proto)
    config = ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, rollout_n=1)
    for name, path in traffic.model_paths.items():
        model = _load(path)
        logits = model(
            input_ids=tensors["input_ids"],
            attention_mask=tensors["attention_mask"],
            position_ids=tensors["position_ids"],
        ).logits[:, p - 1 : p + r - 1]
        log_prob = torch.log_softmax(logits / temperature[:, None, None], dim=-1)
        log_prob = log_prob.gather(2, tensors["responses"].unsqueeze(2)).squeeze(2)
        rows = torch.tensor([t.model == name for t in traffic.trajectories])
        checked = mask & rows[:, None]
        assert checked.sum() > 50, name
        torch.testing.assert_close(log_prob[checked], rollout[checked], atol=ATOL, rtol=0)
        # Both models are untrained, so far from certain: the comparison weighs real probabilities,
        # and the temperature matters (the T=0.7 rows do not match raw logits).
        assert rollout[checked].mean() < -1.0
        raw = torch.log_softmax(logits, dim=-1).gather(2, tensors["responses"].unsqueeze(2)).squeeze(2)
        cooled = checked & (temperature != 1.0)[:, None]
        assert cooled.any() and (raw[cooled] - rollout[cooled]).abs().max() > 0.1

        # verl's policy loss over this model's rows, on the recomputed logprobs.
        loss, metrics = get_policy_loss_fn("vanilla")(
            old_log_prob=rollout[rows],
            log_prob=log_prob[rows],
            advantages=advantages[rows],
            response_mask=tensors["response_mask"][rows],
            loss_agg_mode="token-mean",
            config=config,
        )
        assert loss.ndim == 0 and torch.isfinite(loss) and abs(metrics["actor/ppo_kl"]) < ATOL
        loss.backward()
        grads = [param.grad for param in model.parameters() if param.grad is not None]
        assert grads and all(torch.isfinite(g).all() for g in grads) and any(g.any() for g in grads)
    # Every row has sampled tokens after an inserted (tool result or user) span: multi-turn rows.
    assert all(0 in t.loss_mask[t.prompt_length :] for t in traffic.trajectories)


def test_fidelity_on_the_jagged_layout(traffic: Traffic) -> None:
    """The same proof on the no-padding layout, cut back to responses by verl's ``no_padding_2_padding``."""
    td = to_jagged_tensordict(traffic.trajectories, traffic.uids)
    models = {name: _load(path) for name, path in traffic.model_paths.items()}
    per_token = []
    with torch.inference_mode():
        for t, ids, positions in zip(
            traffic.trajectories, td["input_ids"].unbind(), td["position_ids"].unbind(), strict=True
        ):
            logits = models[t.model](input_ids=ids[None], position_ids=positions[None]).logits[0]
            logp = torch.log_softmax(logits / traffic.temperatures[t.trajectory_id], dim=-1)
            # verl's log_probs[i] is the logprob of token i + 1 (labels rolled left by one)
            per_token.append(logp.gather(1, torch.roll(ids, -1).unsqueeze(1)).squeeze(1))
    nested = torch.nested.as_nested_tensor(per_token, layout=torch.jagged)
    recomputed = no_padding_2_padding(nested, td)
    width = recomputed.shape[1]
    assert width == max(t.response_length for t in traffic.trajectories)
    rollout = torch.stack([torch.nn.functional.pad(x, (0, width - len(x))) for x in td["rollout_log_probs"].unbind()])
    mask = torch.stack([torch.nn.functional.pad(x, (0, width - len(x))) for x in td["response_mask"].unbind()]).bool()
    torch.testing.assert_close(recomputed[mask], rollout[mask], atol=ATOL, rtol=0)


def _assert_nested_equal(ours: torch.Tensor, theirs: torch.Tensor, key: str) -> None:
    assert ours.is_nested and theirs.is_nested, key
    assert ours.dtype == theirs.dtype, key
    assert torch.equal(ours.offsets(), theirs.offsets()), key
    assert torch.equal(ours.values(), theirs.values()), key


def test_jagged_tensordict_equals_verls_conversion_of_the_padded_batch(traffic: Traffic) -> None:
    """``left_right_2_no_padding`` (what verl's trainer does to a padded DataProto) agrees with ours."""
    batch = traffic.batch()
    theirs = left_right_2_no_padding(to_data_proto(batch).to_tensordict())
    ours = to_jagged_tensordict(traffic.trajectories, traffic.uids)
    assert len(ours) == len(batch)
    _assert_nested_equal(ours["input_ids"], theirs["input_ids"], "input_ids")
    _assert_nested_equal(ours["position_ids"], theirs["position_ids"], "position_ids")
    # verl keeps the prompt and response fields padded there; ours are the same rows unpadded.
    attention = theirs["attention_mask"]
    p = theirs["prompts"].shape[1]
    for i, row in enumerate(ours["prompts"].unbind()):
        assert torch.equal(row, theirs["prompts"][i][attention[i, :p].bool()])
    for key in ("responses", "response_mask", "loss_mask", "reasoning_mask", "rollout_log_probs", "rm_scores"):
        for i, row in enumerate(ours[key].unbind()):
            assert row.dtype == theirs[key].dtype, key
            assert torch.equal(row, theirs[key][i, : len(row)]), key
            assert not theirs[key][i, len(row) :].any() or key == "responses", key
    assert list(ours["uid"]) == list(theirs["uid"])
    assert list(ours["num_turns"]) == list(theirs["__num_turns__"])
    assert list(ours["trajectory_id"]) == list(theirs["trajectory_id"])
    assert [e["min_global_steps"] for e in ours["extra_fields"]] == list(theirs["min_global_steps"])


@pytest.mark.filterwarnings(RAY_STATE_API_WARNING)
def test_jagged_tensordict_equals_verls_v1_per_sample_layout(traffic: Traffic) -> None:
    """Built the way ``AgentLoopWorkerTQ._agent_loop_postprocess`` stores samples for the v1 trainer."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    fields = []
    for t, uid in zip(traffic.trajectories, traffic.uids, strict=True):
        cut = t.prompt_length
        output = AgentLoopOutput(
            prompt_ids=t.token_ids[:cut],
            response_ids=t.token_ids[cut:],
            response_mask=t.loss_mask[cut:],
            response_logprobs=t.logprobs[cut:],
            reward_score=t.reward,
            num_turns=2 * t.num_turns,
            metrics=AgentLoopMetrics(),
        )
        field = output.as_dict()
        input_ids = torch.cat([field["prompts"], field["responses"]])
        field["uid"] = uid
        field["loss_mask"] = field["response_mask"]
        field["input_ids"] = input_ids
        field["position_ids"] = compute_position_id_with_mask(torch.ones_like(input_ids)[None])[0]
        fields.append(field)
    theirs = list_of_dict_to_tensordict(fields)
    ours = to_jagged_tensordict(traffic.trajectories, traffic.uids)
    for key in ("prompts", "responses", "response_mask", "loss_mask", "input_ids", "position_ids"):
        _assert_nested_equal(ours[key], theirs[key], key)
    for key in ("rollout_log_probs", "rm_scores"):
        _assert_nested_equal(ours[key], theirs[key], key)
    assert list(ours["uid"]) == list(theirs["uid"])
    assert list(ours["num_turns"]) == list(theirs["num_turns"])


# Edge cases, on hand-made trajectories.


def _trajectory(
    prompt: list[int],
    response: list[int],
    mask: list[int],
    *,
    reward: float | None = 1.0,
    logprobs: list[float] | None = None,
    metadata: dict[str, str] | None = None,
    turn_reward: float | None = None,
) -> Trajectory:
    response_logprobs = logprobs if logprobs is not None else [-0.5 * m for m in mask]
    return Trajectory(
        trajectory_id=f"tr{secrets.token_hex(4)}",
        session_id="sess",
        tenant="t",
        model="m",
        metadata=metadata or {},
        token_ids=prompt + response,
        loss_mask=[0] * len(prompt) + mask,
        logprobs=[0.0] * len(prompt) + response_logprobs,
        prompt_length=len(prompt),
        turns=[
            TurnSummary(
                turn_id="a",
                start=len(prompt),
                length=len(response),
                finish_reason="stop",
                policy_version=3,
                reward=turn_reward,
            )
        ],
        num_turns=1,
        min_policy_version=3,
        max_policy_version=3,
        reward=reward,
        reward_source=None,
        aborted=False,
        truncated=False,
        complete=True,
        emitted_because="closed",
        started_at=0.0,
        ended_at=1.0,
    )


def test_left_padding_and_position_ids_for_rows_of_different_prompt_lengths() -> None:
    rows = [
        _trajectory([5, 6, 7], [8, 9], [1, 1], reward=2.0, turn_reward=0.5),
        _trajectory([5], [8, 9, 10], [1, 0, 1], reward=-1.0),
    ]
    batch = padded_batch(rows, ["g", "g"], prompt_length=4, response_length=4, pad_token_id=99)
    t = {k: v.tolist() for k, v in batch.tensors.items()}
    assert t["prompts"] == [[99, 5, 6, 7], [99, 99, 99, 5]]
    assert t["responses"] == [[8, 9, 99, 99], [8, 9, 10, 99]]
    assert t["input_ids"] == [[99, 5, 6, 7, 8, 9, 99, 99], [99, 99, 99, 5, 8, 9, 10, 99]]
    assert t["attention_mask"] == [[0, 1, 1, 1, 1, 1, 0, 0], [0, 0, 0, 1, 1, 1, 1, 0]]
    assert t["position_ids"] == [[0, 0, 1, 2, 3, 4, 4, 4], [0, 0, 0, 0, 1, 2, 3, 3]]
    assert t["response_mask"] == [[1, 1, 0, 0], [1, 0, 1, 0]]
    assert t["rollout_log_probs"] == [[-0.5, -0.5, 0.0, 0.0], [-0.5, 0.0, -0.5, 0.0]]
    assert t["rm_scores"] == [[0.0, 2.0, 0.0, 0.0], [0.0, 0.0, -1.0, 0.0]]
    assert torch.equal(batch.tensors["position_ids"], compute_position_id_with_mask(batch.tensors["attention_mask"]))
    assert batch.non_tensors["turn_scores"].shape == (2,) and list(batch.non_tensors["turn_scores"]) == [[0.5], []]
    assert list(batch.non_tensors["tool_rewards"]) == [[], []]
    assert list(batch.non_tensors["min_global_steps"]) == [3, 3]


def test_logprobs_of_unsampled_positions_are_zeroed() -> None:
    row = _trajectory([5], [8, 9], [1, 0], logprobs=[-0.25, -7.0])
    batch = padded_batch([row], ["g"], prompt_length=1, response_length=2, pad_token_id=0)
    assert batch.tensors["rollout_log_probs"].tolist() == [[-0.25, 0.0]]
    assert to_jagged_tensordict([row], ["g"])["rollout_log_probs"].values().tolist() == [-0.25, 0.0]


def test_no_reward_scores_zero_and_still_trains() -> None:
    rows = [_trajectory([5, 6], [8, 9], [1, 1], reward=None), _trajectory([5, 6], [8], [1], reward=None)]
    proto = to_data_proto(padded_batch(rows, ["g", "g"], prompt_length=2, response_length=3, pad_token_id=0))
    assert not proto.batch["rm_scores"].any()
    assert not _grpo(proto).any()
    assert not to_jagged_tensordict(rows, ["g", "g"])["rm_scores"].values().any()


@pytest.mark.parametrize(
    ("prompt_length", "response_length", "message"),
    [
        (2, 4, "prompt of 3 tokens is longer than prompt_length=2"),
        (4, 1, "response of 2 tokens is longer than response_length=1"),
        (0, 4, "must be >= 1"),
    ],
)
def test_too_long_rows_are_refused(prompt_length: int, response_length: int, message: str) -> None:
    row = _trajectory([5, 6, 7], [8, 9], [1, 1])
    with pytest.raises(ValueError, match=message):
        padded_batch([row], ["g"], prompt_length=prompt_length, response_length=response_length, pad_token_id=0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"logprobs": [0.0, 0.0, -0.1]}, "4 token ids, 4 mask values and 3 logprobs"),
        ({"loss_mask": [0, 0, 1]}, "4 token ids, 3 mask values and 4 logprobs"),
        ({"loss_mask": [0, 0, 2, 1]}, "other than 0 and 1"),
        ({"loss_mask": [1, 0, 1, 1]}, "inside the first prompt"),
        ({"prompt_length": 4}, "empty prompt or response"),
        ({"prompt_length": 0}, "empty prompt or response"),
        ({"reasoning_mask": [0, 0, 1]}, "4 token ids and 3 reasoning_mask values"),
        ({"reasoning_mask": [0, 0, 2, 0]}, "reasoning_mask must be 0 or 1"),
        ({"reasoning_mask": [1, 0, 0, 0]}, "1 only on sampled ids"),
        ({"routed_experts": ExpertRoutes.of(np.zeros((4, 1, 2), np.uint8))}, "4 rows for 4 token ids"),
        (
            {"routed_experts": ExpertRoutes.of(np.zeros((3, 1, 2), np.uint8)).model_copy(update={"data": "AAAA"})},
            "does not hold 6 bytes",
        ),
    ],
)
def test_inconsistent_trajectories_are_refused(change: dict[str, Any], message: str) -> None:
    # model_copy skips validation, as a buggy producer might: the batcher must still refuse.
    row = _trajectory([5, 6], [8, 9], [1, 1]).model_copy(update=change)
    with pytest.raises(ValueError, match=message):
        padded_batch([row], ["g"], prompt_length=4, response_length=4, pad_token_id=0)
    with pytest.raises(ValueError, match=message):
        to_jagged_tensordict([row], ["g"])


def test_uids_and_empty_batches_are_checked() -> None:
    row = _trajectory([5], [8], [1])
    with pytest.raises(ValueError, match="2 uids for 1 trajectories"):
        padded_batch([row], ["a", "b"], prompt_length=1, response_length=1, pad_token_id=0)
    with pytest.raises(ValueError, match="at least one trajectory"):
        to_jagged_tensordict([], [])


def test_group_uid() -> None:
    a = _trajectory([5, 6], [8], [1], metadata={"group": "g1"})
    b = _trajectory([5, 6], [9, 10], [1, 1])
    c = _trajectory([5, 7], [8], [1])
    assert group_uid(a, "metadata:group") == "t/g1"  # a label is its tenant's name
    # A session without the metadata groups by its prompt, as the batcher groups it (one definition).
    assert group_uid(b, "metadata:group") == group_uid(b, "prompt")
    assert group_uid(a, "prompt") == group_uid(b, "prompt") != group_uid(c, "prompt")
    other = a.model_copy(update={"tenant": "u"})  # the same label and prompt in another tenant: another group
    assert group_uid(other, "metadata:group") == "u/g1" and group_uid(other, "prompt") != group_uid(a, "prompt")
    assert len(group_uid(a, "prompt")) == 64
    for bad in ("metadata:", "session", ""):
        with pytest.raises(ValueError, match="unknown group key"):
            group_uid(a, bad)


# Routed experts (Rollout Routing Replay, "R3"), checked against verl 0.9.1's own code.

LAYERS, TOP_K = 2, 2


def _route_of(token: int, layer: int) -> list[int]:
    """The (made-up) top-2 of 8 experts that routed ``token`` in ``layer``: a function of the id, to check alignment."""
    first = (3 * token + layer) % 8
    return [first, (first + 1 + token % 7) % 8]


def _routes_of(tokens: list[int]) -> np.ndarray:
    """One row per id but the last (the last is never fed to the model), as the assembler builds them."""
    return np.array([[_route_of(t, layer) for layer in range(LAYERS)] for t in tokens[:-1]], dtype=np.uint8)


def _routed(trajectory: Trajectory) -> Trajectory:
    return trajectory.model_copy(update={"routed_experts": ExpertRoutes.of(_routes_of(trajectory.token_ids))})


def _routed_rows() -> list[Trajectory]:
    """Rows of different prompt and response lengths: left padding differs, right padding too."""
    return [
        _routed(_thinking_trajectory()),
        _routed(_trajectory([5, 6], [8, 9, 10], [1, 0, 1])),
        _routed(_trajectory([30], [31], [1])),
    ]


def test_routed_experts_reach_both_layouts_aligned_with_input_ids() -> None:
    """Padded: [B, P+R, L, K] int16, column j the route of input_ids[:, j], zero on padding and the last id."""
    rows = _routed_rows()
    uids = ["u", "v", "w"]
    batch = padded_batch(rows, uids, prompt_length=4, response_length=11, pad_token_id=0)
    routed, input_ids, attention = (batch.tensors[k] for k in ("routed_experts", "input_ids", "attention_mask"))
    assert routed.dtype == torch.int16 and routed.shape == (3, 15, LAYERS, TOP_K)
    for i, trajectory in enumerate(rows):
        real = attention[i].nonzero().flatten().tolist()
        assert len(real) == len(trajectory.token_ids) and real[0] == 4 - trajectory.prompt_length
        for j in range(15):
            if j in real[:-1]:
                expected = [_route_of(int(input_ids[i, j]), layer) for layer in range(LAYERS)]
                assert routed[i, j].tolist() == expected, (i, j)
            else:  # left padding, right padding, and the last real id (it routed nothing)
                assert not routed[i, j].any(), (i, j)
        start = 4 - trajectory.prompt_length
        fed = routed[i, start : start + len(trajectory.token_ids) - 1].numpy()
        assert np.array_equal(fed, trajectory.routed_experts.array())  # type: ignore[union-attr]
    proto = to_data_proto(batch)  # check_consistency: the batch dimension agrees
    assert torch.equal(proto.select_idxs([2, 0]).batch["routed_experts"][1], routed[0])
    assert DataProto.concat([proto, proto]).batch["routed_experts"].shape == (6, 15, LAYERS, TOP_K)

    # Jagged: per row [len(input_ids), L, K] int16, the last row zero, on input_ids' offsets; and
    # equal to what verl's trainer makes of the padded batch (left_right_2_no_padding).
    jagged = to_jagged_tensordict(rows, uids)
    nested = jagged["routed_experts"]
    assert nested.is_nested and nested.dtype == torch.int16
    assert torch.equal(nested.offsets(), jagged["input_ids"].offsets())
    for trajectory, row in zip(rows, nested.unbind(), strict=True):
        assert row.shape == (len(trajectory.token_ids), LAYERS, TOP_K) and not row[-1].any()
        assert np.array_equal(row[:-1].numpy(), trajectory.routed_experts.array())  # type: ignore[union-attr]
    theirs = left_right_2_no_padding(proto.to_tensordict())
    _assert_nested_equal(nested, theirs["routed_experts"], "routed_experts")
    _assert_nested_equal(jagged["input_ids"], theirs["input_ids"], "input_ids")


def _verl_function(module_path: str, name: str) -> Any:
    """One function of a verl module that cannot be imported here (Megatron is not installed), by its source."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("verl")
    assert spec is not None and spec.submodule_search_locations
    path = Path(next(iter(spec.submodule_search_locations))) / module_path
    tree = ast.parse(path.read_text())
    [node] = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    namespace: dict[str, Any] = {"torch": torch}
    exec(compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec"), namespace)  # verl's own code
    return namespace[name]


def test_megatron_r3_takes_the_jagged_routes_and_replays_all_rows_but_the_last() -> None:
    """verl's ``align_r3_router_replay_data`` and ``build_r3_replay_mask`` (router_replay_utils.py) on our batch."""
    align = _verl_function("utils/megatron/router_replay_utils.py", "align_r3_router_replay_data")
    replay_mask = _verl_function("utils/megatron/router_replay_utils.py", "build_r3_replay_mask")
    rows = _routed_rows()
    jagged = to_jagged_tensordict(rows, ["u", "v", "w"])
    aligned = align(jagged["routed_experts"], jagged["input_ids"])
    _assert_nested_equal(aligned, jagged["routed_experts"], "routed_experts")  # already one row per input id
    mask = replay_mask(jagged["input_ids"], jagged["response_mask"])
    assert [row.tolist() for row in mask.unbind()] == [[True] * (len(t.token_ids) - 1) + [False] for t in rows]
    # One row short is also verl's (it pads it); two rows short is refused there, and by us before.
    short = torch.nested.as_nested_tensor([r[:-2] for r in jagged["routed_experts"].unbind()], layout=torch.jagged)
    with pytest.raises(RuntimeError, match="expected equal lengths or exactly one missing final route"):
        align(short, jagged["input_ids"])


@pytest.mark.filterwarnings(RAY_STATE_API_WARNING)
def test_routed_experts_equal_verls_own_agent_loop_postprocessing(tiny_model_path: Path) -> None:
    """The same rows, with the routes a rollout engine reports (every id but the last), through verl's agent loop.

    Padded: ``AgentLoopWorker._agent_loop_postprocess`` then ``_postprocess``; jagged (v1):
    ``AgentLoopOutput.as_dict`` stacked by ``list_of_dict_to_tensordict``.
    """
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput, AgentLoopWorker
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    rows = _routed_rows()
    uids = ["u", "v", "w"]
    worker = object.__new__(AgentLoopWorker)
    worker.tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    worker.processor = None
    worker.rollout_config = SimpleNamespace(prompt_length=4, response_length=11)
    worker.reward_loop_worker_handles = None
    worker.distillation_enabled = False
    worker.mm_processor_kwargs = {}

    def output(t: Trajectory) -> AgentLoopOutput:
        cut = t.prompt_length
        return AgentLoopOutput(
            prompt_ids=t.token_ids[:cut],
            response_ids=t.token_ids[cut:],
            response_mask=t.loss_mask[cut:],
            response_logprobs=t.logprobs[cut:],
            routed_experts=t.routed_experts.array(),  # type: ignore[union-attr]
            reward_score=t.reward,
            num_turns=2 * t.num_turns,
            metrics=AgentLoopMetrics(),
        )

    async def postprocess() -> DataProto:
        outputs = [await worker._agent_loop_postprocess(output(t), validate=False, raw_prompt=[]) for t in rows]
        result: DataProto = worker._postprocess(outputs, input_non_tensor_batch={"uid": np.array(uids, dtype=object)})
        return result

    verls = asyncio.run(postprocess())
    ours = to_data_proto(padded_batch(rows, uids, prompt_length=4, response_length=11, pad_token_id=0))
    assert verls.batch["routed_experts"].dtype == ours.batch["routed_experts"].dtype == torch.int16
    assert torch.equal(verls.batch["routed_experts"], ours.batch["routed_experts"])
    assert torch.equal(verls.batch["input_ids"], ours.batch["input_ids"])

    fields = []
    for t in rows:
        field = output(t).as_dict()
        field["input_ids"] = torch.cat([field["prompts"], field["responses"]])
        fields.append({k: field[k] for k in ("input_ids", "routed_experts")})
    theirs = list_of_dict_to_tensordict(fields)
    jagged = to_jagged_tensordict(rows, uids)
    _assert_nested_equal(jagged["routed_experts"], theirs["routed_experts"], "routed_experts")
    _assert_nested_equal(jagged["input_ids"], theirs["input_ids"], "input_ids")


def test_routed_experts_round_trip_the_parquet_and_old_files_read_without() -> None:
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    from consumers.parquet import decode_batch, encode_batch

    rows = [*_routed_rows(), _trajectory([5], [8], [1])]  # a parquet may mix them; a verl batch may not
    uids = ["u", "v", "w", "x"]
    data = encode_batch(rows, uids, batch_id="b", prompt_length=4, response_length=11)
    assert decode_batch(data) == (rows, uids)
    table = pq.read_table(io.BytesIO(data))
    schema = table.schema
    assert schema.field("routed_experts").type == pa.large_binary()
    assert schema.field("routed_experts_shape").type == pa.list_(pa.int32())
    assert schema.field("routed_experts_dtype").type == pa.string()
    raw = table.column("routed_experts").to_pylist()
    assert raw[:3] == [t.routed_experts.array().tobytes() for t in rows[:3]] and raw[3] is None  # type: ignore[union-attr]
    assert table.column("routed_experts_shape").to_pylist()[0] == [11, LAYERS, TOP_K]
    assert table.column("routed_experts_dtype").to_pylist() == ["uint8"] * 3 + [None]
    # The raw bytes read back without this package: numpy's view of the column is the array.
    first = np.frombuffer(raw[0], dtype="uint8").reshape(table.column("routed_experts_shape").to_pylist()[0])
    assert np.array_equal(first, _routes_of(rows[0].token_ids))

    # A batch written before routes (no columns, schema 3) reads with none.
    old = table.drop_columns(["routed_experts", "routed_experts_shape", "routed_experts_dtype"])
    old = old.set_column(old.schema.get_field_index("schema_version"), "schema_version", pa.array([3] * 4, pa.int8()))
    sink = io.BytesIO()
    pq.write_table(old, sink)
    decoded, old_uids = decode_batch(sink.getvalue())
    assert old_uids == uids and all(t.routed_experts is None and t.schema_version == 3 for t in decoded)
    assert [
        t.model_copy(update={"schema_version": TRAJECTORY_SCHEMA_VERSION, "routed_experts": r.routed_experts})
        for t, r in zip(decoded, rows, strict=True)
    ] == rows


def test_a_batch_mixing_routed_and_unrouted_rows_is_refused() -> None:
    routed, plain = _routed(_trajectory([5, 6], [8, 9], [1, 1])), _trajectory([5], [8, 9, 10], [1, 0, 1])
    message = f"trajectory {plain.trajectory_id} has no routed_experts while trajectory {routed.trajectory_id}"
    with pytest.raises(ValueError, match=message):
        padded_batch([routed, plain], ["g", "g"], prompt_length=2, response_length=3, pad_token_id=0)
    with pytest.raises(ValueError, match=message):
        to_jagged_tensordict([routed, plain], ["g", "g"])
    # None routed: no key at all (verl's own batches of a dense model have none).
    assert (
        "routed_experts" not in padded_batch([plain], ["g"], prompt_length=2, response_length=3, pad_token_id=0).tensors
    )
    assert "routed_experts" not in to_jagged_tensordict([plain], ["g"])
    # Different (layers, top_k), or expert ids over int16 (verl's dtype): refused too.
    other = routed.model_copy(update={"routed_experts": ExpertRoutes.of(np.zeros((3, 3, 2), np.uint8))})
    with pytest.raises(ValueError, match=r"routed_experts of \[2, 2\] \(layers, top_k\), not \[3, 2\]"):
        padded_batch([other, routed], ["g", "g"], prompt_length=2, response_length=3, pad_token_id=0)
    huge = routed.model_copy(update={"routed_experts": ExpertRoutes.of(np.full((3, 2, 2), 40000, np.uint16))})
    with pytest.raises(ValueError, match="an expert id over int16"):
        to_jagged_tensordict([huge], ["g"])


def test_the_batchers_policies_cut_routes_with_the_ids_and_drop_misaligned_ones() -> None:
    from consumers.grouping import prepare_trajectory

    trajectory = _routed(_thinking_trajectory())  # 12 ids, prompt 3: 11 rows
    policy: dict[str, Any] = {"prompt_length": 4, "overlong": "truncate", "no_reward": "drop"}
    cut = prepare_trajectory(trajectory, response_length=5, **policy)
    assert isinstance(cut, Trajectory) and cut.truncated and len(cut.token_ids) == 8
    assert cut.routed_experts is not None and cut.routed_experts.shape == (7, LAYERS, TOP_K)
    assert np.array_equal(cut.routed_experts.array(), _routes_of(cut.token_ids))
    assert Trajectory.model_validate(cut.model_dump()) == cut  # still a valid trajectory
    padded_batch([cut], ["g"], prompt_length=4, response_length=5, pad_token_id=0)
    assert prepare_trajectory(trajectory, response_length=11, **policy) == trajectory  # fits: untouched
    for rows in (10, 12):
        bad = trajectory.model_copy(update={"routed_experts": ExpertRoutes.of(_routes_of([0] * (rows + 1)))})
        assert prepare_trajectory(bad, response_length=11, **policy) == "malformed"


# -- LoRA adapters ------------------------------------------------------------------------------


def test_the_adapter_reaches_both_layouts_and_the_parquet_and_old_files_read_as_the_base() -> None:
    """``adapter`` per row, a non-tensor like ``uid`` (dtype object), carried by verl's batch operations."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    from consumers.parquet import decode_batch, encode_batch

    base = _trajectory([5, 6], [8, 9], [1, 1])
    rows = [
        base.model_copy(update={"adapter": "alpha"}),
        _trajectory([5], [8, 9, 10], [1, 0, 1]).model_copy(update={"adapter": "alpha"}),
    ]
    uids = ["u", "u"]
    proto = to_data_proto(padded_batch(rows, uids, prompt_length=4, response_length=4, pad_token_id=0))
    adapters = proto.non_tensor_batch["adapter"]
    assert adapters.dtype == object and adapters.shape == (2,) and list(adapters) == ["alpha", "alpha"]
    assert list(DataProto.concat([proto, proto]).non_tensor_batch["adapter"]) == ["alpha"] * 4
    assert list(proto.repeat(repeat_times=2, interleave=True).non_tensor_batch["adapter"]) == ["alpha"] * 4
    assert list(proto.select_idxs([1]).non_tensor_batch["adapter"]) == ["alpha"]
    assert list(pickle.loads(pickle.dumps(proto)).non_tensor_batch["adapter"]) == ["alpha", "alpha"]
    jagged = to_jagged_tensordict(rows, uids)
    assert [jagged[i]["adapter"] for i in range(2)] == ["alpha", "alpha"]
    # The base model's rows say None (a batch mixing the two is not the batcher's, but is laid out as given).
    mixed = [rows[0], base]
    proto = to_data_proto(padded_batch(mixed, uids, prompt_length=4, response_length=4, pad_token_id=0))
    assert list(proto.non_tensor_batch["adapter"]) == ["alpha", None]
    assert [to_jagged_tensordict(mixed, uids)[i]["adapter"] for i in range(2)] == ["alpha", None]

    data = encode_batch(rows, uids, batch_id="b", prompt_length=4, response_length=4)
    assert decode_batch(data) == (rows, uids)
    table = pq.read_table(io.BytesIO(data))
    field = table.schema.field("adapter")
    assert field.type == pa.string() and field.nullable and table.column("adapter").to_pylist() == ["alpha", "alpha"]
    assert pq.read_table(
        io.BytesIO(encode_batch(mixed, uids, batch_id="m", prompt_length=4, response_length=4))
    ).column("adapter").to_pylist() == ["alpha", None]
    # A batch written before adapters (no column) reads as the base model's.
    sink = io.BytesIO()
    pq.write_table(table.drop_columns(["adapter"]), sink)
    decoded, old_uids = decode_batch(sink.getvalue())
    assert old_uids == uids and [t.adapter for t in decoded] == [None, None]
    assert [t.model_copy(update={"adapter": "alpha"}) for t in decoded] == rows
