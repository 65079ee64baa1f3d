"""verl 0.9.1's v1 trainers (sync and separate-async) fed by a gateway, through verl's own code.

The pipeline is real: a nats-server, a gateway (the scripted engine on the untrained tiny model,
sampling at temperature 1, so that a forward pass of the same weights reproduces its logprobs), the
assembler and the batcher. Sessions are driven with the official client, scored with
``POST /sessions/{id}/feedback`` and closed. The trainer is verl's: the configuration is the block
in docs/batches.md, ``TaskRunnerV1.run`` builds TransferQueue, the trainer, and the manager through
``init_agent_loop_manager``, and ``fit`` runs its steps: the replay buffer, GRPO advantages, rollout
correction and metrics are verl's. Only the GPU worker groups are replaced, by the CPU actor of
tests/support/verl_cpu.py (the real tiny model: a forward pass for log-probs, an SGD step, its
weights handed on as verl's actor worker hands them). The trainer is a Ray driver, so it runs in a
child process with a Ray node of its own (tests/support/ray_child.py: a hang there is killed and
told, not waited for); the gateway, NATS and the consumers stay in the test's process.
"""

from __future__ import annotations

import re
import threading
import time
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import torch
from omegaconf import DictConfig, OmegaConf
from openai import OpenAI

from consumers.assembler import AssemblerConfig, run_assembler
from consumers.batcher import BatcherConfig, run_batcher
from consumers.trajectory import Trajectory
from pipeline.embedded import EmbeddedNatsServer
from stream_gateway import Settings
from stream_gateway.engines import build_engine

from ..support.capture import read_trajectories
from ..support.ray_child import RayChild, call_parent
from ..support.replicas import close_session
from ..support.servers import RunningGateway, run_gateway
from ..support.verl_cpu import CpuActor, cpu_trainers
from ..support.waiting import wait_until

# verl's and Ray's own import-time warnings (optional engines, deprecations) are not ours to judge.
pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning:verl"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

ROOT = Path(__file__).resolve().parents[2]
KEY = "sk-v1"
GROUPS = 4  # two batches of two groups of two
SCORES = (0.0, 1.0)  # each group: one session rated 0, one rated 1


def docs_block(marker: str) -> str:
    """The fenced YAML block that follows ``<!-- marker -->`` in docs/batches.md."""
    text = (ROOT / "docs" / "batches.md").read_text()
    found = re.search(rf"<!-- {marker} -->\n```yaml\n(.*?)```", text, re.S)
    assert found, f"docs/batches.md has no {marker} block"
    return found.group(1)


@dataclass
class Stack:
    server: EmbeddedNatsServer
    nats: str
    gateway: RunningGateway
    batches: Path

    def session(self, name: str, question: str) -> None:
        session(self.gateway.base_url, name, question)


def session(base_url: str, name: str, question: str) -> None:
    """One real session: two turns, feedback, close."""
    client = OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0, default_headers={"x-session-id": name})
    messages: list[Any] = [{"role": "user", "content": question}]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=1.0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And again?"}]  # fmt: skip
    client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=1.0)
    score = SCORES[name.endswith("-b")]
    httpx.post(f"{base_url}/sessions/{name}/feedback", json={"score": score},
               headers={"authorization": f"Bearer {KEY}"}).raise_for_status()  # fmt: skip
    close_session(base_url, KEY, name)


@pytest.fixture
def stack(tmp_path: Path, tiny_model_path: Path) -> Iterator[Stack]:
    with EmbeddedNatsServer() as nats, anyio.from_thread.start_blocking_portal() as portal:
        assembler = AssemblerConfig(servers=(nats.url,), idle_timeout_s=30, close_grace_s=0.5)
        batcher = BatcherConfig.of(servers=(nats.url,), batch_size=4, group_size=2, prompt_length=2048,
                                   response_length=2048, output_dir=tmp_path / "batches")  # fmt: skip
        tasks = [portal.start_task_soon(run_assembler, assembler), portal.start_task_soon(run_batcher, batcher)]
        settings = Settings(model=str(tiny_model_path), served_model_name="tiny", engine="scripted",
                            nats_url=nats.url, outbox_dir=tmp_path / "outbox", replica_id="g1",
                            api_keys=(KEY,))  # fmt: skip
        with run_gateway(build_engine(settings), settings) as gateway:
            yield Stack(nats, nats.url, gateway, tmp_path / "batches")
        for task in tasks:
            task.cancel()


def ray_child(target: Any, *args: Any) -> RayChild:
    """A Ray child per test: verl's trainer names its actors (``reward_loop_worker_0``...), one trainer
    per Ray. num_cpus is a scheduling count, not cores: verl's reward worker, TransferQueue's actors
    and the replica's worker each take one. Its workers import consumers.* and tests.*."""
    return RayChild(target, *args, num_cpus=8, namespace=f"v1-{uuid.uuid4().hex[:8]}", pythonpath=ROOT)


def trainer_config(
    stack: Stack, model: Path, tmp: Path, *, steps: int, separate_async: bool = False, extra: tuple[str, ...] = ()
) -> DictConfig:
    """The docs' block (and the separate-async one), composed over verl's ppo_trainer, with this test's
    model, NATS server, step count and checkpoint directory."""
    from hydra import compose, initialize_config_dir

    (tmp / "trainer.yaml").write_text(docs_block("verl-v1-config"))
    overrides = [
        f"actor_rollout_ref.model.path={model}",
        f"actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.nats.servers=[{stack.nats}]",
        f"actor_rollout_ref.rollout.custom.stream_gateway.nats_url={stack.nats}",
        f"trainer.total_training_steps={steps}",
        f"trainer.default_local_dir={tmp / 'checkpoints'}",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",  # a 2-core machine
        *extra,
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with initialize_config_dir(config_dir=str(tmp), version_base=None):
            config = compose(config_name="trainer", overrides=overrides)
    if separate_async:
        config = OmegaConf.merge(config, OmegaConf.create(docs_block("verl-v1-separate-async")))
    return config


def run_task_runner(config: DictConfig) -> Any:
    """``TaskRunnerV1.run`` (verl/trainer/main_ppo.py) in this process, as its Ray actor runs it."""
    from verl.trainer.main_ppo import TaskRunnerV1

    runner = TaskRunnerV1.__ray_metadata__.modified_class()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # verl's, torchdata's and Ray's deprecations are not ours to judge
        runner.run(config)
    return runner


def train(config: DictConfig) -> dict[str, Any]:
    """In the Ray child: the trainer with the CPU worker groups, run to its end; what the tests read
    of it (every update's batch, the steps published, what the manager placed)."""
    with cpu_trainers():
        runner = run_task_runner(config)
    manager = runner.agent_loop_manager
    manager.close()  # verl's TaskRunnerV1 never closes it: its process ends instead
    return {"seen": CpuActor.seen, "published": CpuActor.published,
            "placed": (manager.groups_placed, manager.samples_placed)}  # fmt: skip


def _emitted(stack: Stack) -> list[Trajectory]:
    return [t for t in read_trajectories(stack.nats) if t.reward is not None]


@pytest.mark.timeout(720)  # the Ray child's start may be made twice (2 x 180 s), then 300 s
def test_the_sync_trainer_trains_on_the_gateways_groups_token_exactly(
    stack: Stack, tiny_model_path: Path, tmp_path: Path
) -> None:
    for g in range(GROUPS):
        for side in ("a", "b"):
            stack.session(f"q{g}-{side}", f"Question number {g}?")
    wait_until(lambda: len(list(stack.batches.glob("*.parquet"))) == 2, timeout=60, what="two batches")
    trajectories = {t.trajectory_id: t for t in _emitted(stack)}
    assert len(trajectories) == 2 * GROUPS

    config = trainer_config(stack, tiny_model_path, tmp_path, steps=2)
    trained = ray_child(train, config).run(timeout=300)
    assert trained["placed"] == (GROUPS, 2 * GROUPS)

    # Each step trained on one stream batch's groups: whole, once, token for token.
    assert len(trained["seen"]) == 2
    seen_ids: list[str] = []
    for update in trained["seen"]:
        data, padding = update["data"], update["padding"]
        rows = [i for i, pad in enumerate(padding) if not pad]
        assert len(rows) == 4
        by_uid: dict[str, list[str]] = {}
        for i in rows:
            trajectory = trajectories[data["trajectory_id"][i]]
            seen_ids.append(trajectory.trajectory_id)
            by_uid.setdefault(data["uid"][i], []).append(trajectory.trajectory_id)
            p = trajectory.prompt_length
            assert data["input_ids"][i].tolist() == trajectory.token_ids
            assert data["responses"][i].tolist() == trajectory.token_ids[p:]
            assert data["response_mask"][i].tolist() == trajectory.loss_mask[p:]
            recorded = [
                lp if m else 0.0 for lp, m in zip(trajectory.logprobs[p:], trajectory.loss_mask[p:], strict=True)
            ]
            assert data["rollout_log_probs"][i].tolist() == pytest.approx(recorded, abs=0)
            rewards = data["rm_scores"][i].tolist()
            assert rewards[-1] == trajectory.reward and not any(rewards[:-1])
            # The actor's forward pass of the gateway's weights gives the recorded logprobs.
            sampled = torch.tensor(trajectory.loss_mask[p:], dtype=torch.bool)
            assert torch.allclose(data["old_log_probs"][i][sampled], data["rollout_log_probs"][i][sampled], atol=2e-4)
            # Rollout correction ran on them: importance weights of one.
            assert torch.allclose(data["rollout_is_weights"][i][sampled], torch.ones(int(sampled.sum())), atol=1e-3)
            # GRPO: rewards 0 and 1 in a group of two give -/+ 0.7071 on every sampled token.
            advantage = data["advantages"][i][sampled]
            assert torch.allclose(
                advantage, torch.full_like(advantage, 0.7071 if trajectory.reward else -0.7071), atol=1e-3
            )
        assert sorted(len(group) for group in by_uid.values()) == [2, 2]
        for group in by_uid.values():  # a slot holds one of the stream's groups, whole
            assert len({_prompt(trajectories[t]) for t in group}) == 1
    assert sorted(seen_ids) == sorted(trajectories)  # every trajectory, none twice

    # Weights back: each step's weights were published, and the gateway labels new turns with them.
    assert trained["published"] == [1, 2]
    wait_until(lambda: stack.gateway.engine.policy_version == 2, timeout=60, what="version 2 applied")
    stack.session("after-b", "Question after training?")
    wait_until(lambda: any(t.session_id == "after-b" for t in read_trajectories(stack.nats)), timeout=30,
               what="the next session's trajectory")  # fmt: skip
    [after] = [t for t in read_trajectories(stack.nats) if t.session_id == "after-b"]
    assert after.min_policy_version == 2 == after.max_policy_version


@pytest.mark.timeout(720)  # the Ray child's start may be made twice (2 x 180 s), then 300 s
def test_the_separate_async_trainer_trains_while_users_talk(
    stack: Stack, tiny_model_path: Path, tmp_path: Path
) -> None:
    """The off-policy mode: the trainer starts before any traffic and waits without blocking; step 1's
    weights reach the gateway through verl's own non-naive weight sync (the nats engine, the
    stream_gateway replica's CPU worker), and the sessions that follow are sampled by them and train step 2."""
    config = trainer_config(stack, tiny_model_path, tmp_path, steps=2, separate_async=True)
    child = ray_child(train, config)
    try:
        child.start()
        for g in range(2):
            for side in ("a", "b"):
                stack.session(f"early{g}-{side}", f"Early question {g}?")
        wait_until(lambda: stack.gateway.engine.policy_version == 1 or child.finished(), timeout=120,
                   what="step 1's weights applied")  # fmt: skip
        if stack.gateway.engine.policy_version != 1:
            child.result(timeout=0)  # the trainer ended early: its failure
        for g in range(2):
            for side in ("a", "b"):
                stack.session(f"later{g}-{side}", f"Later question {g}?")
        trained = child.result(timeout=180)
    finally:
        child.close()

    assert len(trained["seen"]) == 2 and trained["published"] == [1, 2]
    for step, update in enumerate(trained["seen"], start=1):
        rows = [i for i, pad in enumerate(update["padding"]) if not pad]
        versions = {v for i in rows for v in update["data"]["policy_versions"][i].tolist() if v >= 0}
        assert versions == {step - 1}, (step, versions)  # step 2 trained what step 1's weights sampled
        assert {update["tags"][i]["min_global_steps"] for i in rows} == {step - 1}
        assert len({update["data"]["uid"][i] for i in rows}) == 2
    wait_until(lambda: stack.gateway.engine.policy_version == 2, timeout=60, what="version 2 applied")


def _prompt(trajectory: Trajectory) -> str:
    return str(trajectory.token_ids[: trajectory.prompt_length])


def _prompts(uids: list[str], step: int) -> Any:
    """What the trainer's ``_submit_batch_to_rollout`` hands over: the slots, registered as pending."""
    import transfer_queue as tq
    from tensordict import NonTensorData, NonTensorStack, TensorDict

    tags = [{"is_prompt": True, "status": "pending", "global_steps": step} for _ in uids]
    tq.kv_batch_put(keys=uids, partition_id="train", tags=tags)
    stack = NonTensorStack.from_list([NonTensorData(u) for u in uids])
    return TensorDict({"uid": stack, "global_steps": NonTensorData(step)}, batch_size=[len(uids)])


@pytest.mark.timeout(720)  # the Ray child's start may be made twice (2 x 180 s), then 300 s
def test_slots_wait_without_blocking_and_a_nats_restart_mid_batch_loses_and_duplicates_nothing(
    stack: Stack, tiny_model_path: Path, tmp_path: Path
) -> None:
    """A slot asked for on an empty stream: ``generate_sequences`` returns at once, the slot waits
    (``running``) and is filled when sessions come, with one group of the first batch; the batch is
    then half placed, NATS restarts, the rest is asked for: every group lands in exactly one slot,
    and a manifest that comes again is skipped. The manager and TransferQueue are the Ray child's
    (:func:`_slots`); it asks this process to restart NATS."""
    import nats as nats_client

    ack_wait = "+actor_rollout_ref.rollout.custom.stream_gateway.ack_wait_s=4"
    config = trainer_config(stack, tiny_model_path, tmp_path, steps=1, extra=(ack_wait,))
    OmegaConf.resolve(config)
    child = ray_child(_slots, config, stack.gateway.base_url, stack.nats, stack.batches)
    child.calls["restart_nats"] = stack.server.restart
    child.run(timeout=300)

    async def consumer() -> Any:
        nc = await nats_client.connect(stack.nats)
        try:
            return await nc.jetstream().consumer_info("SG_BATCHES", "verl-trainer")
        finally:
            await nc.close()

    info = anyio.run(consumer)
    assert (info.num_ack_pending, info.num_pending) == (0, 0)


def _slots(config: DictConfig, base_url: str, nats_url: str, batches: Path) -> None:
    """In the Ray child: the slots test's manager side, asserting as it goes."""
    import transfer_queue as tq

    from consumers.verl_v1 import StreamAgentLoopManagerTQ

    tq.init(config.transfer_queue)
    manager = StreamAgentLoopManagerTQ.create(config=config)
    try:
        first = [str(uuid.uuid4())]
        done = threading.Event()
        threading.Thread(
            target=lambda: (manager.generate_sequences(_prompts(first, 1)), done.set()), daemon=True
        ).start()
        assert done.wait(30), "generate_sequences blocked with no batch in the stream"
        assert tq.kv_list("train")["train"][first[0]]["status"] == "running"

        for g in range(GROUPS):
            for side in ("a", "b"):
                session(base_url, f"r{g}-{side}", f"Restart question {g}?")
        wait_until(lambda: manager.groups_placed == 1, timeout=60, what="one group placed")
        tags = tq.kv_list("train")["train"]
        assert tags[first[0]]["status"] == "finished"
        assert tags[first[0]]["global_steps"] == 1  # version 0 sampled the group: step 1's
        assert sorted(k for k in tags if "_" in k) == [f"{first[0]}_{i}_0" for i in range(2)]
        assert {tags[f"{first[0]}_{i}_0"]["min_global_steps"] for i in range(2)} == {0}
        wait_until(lambda: len(list(batches.glob("*.parquet"))) == 2, timeout=60, what="two batches")
        call_parent("restart_nats")
        rest = [str(uuid.uuid4()) for _ in range(GROUPS - 1)]
        manager.generate_sequences(_prompts(rest, 2))
        wait_until(lambda: manager.groups_placed == GROUPS, timeout=90, what="every group placed")
        time.sleep(6)  # past ack_wait: a manifest not acknowledged would come again now
        assert manager.groups_placed == GROUPS and manager.samples_placed == 2 * GROUPS

        # A manifest that comes again (as after an acknowledgement lost to a restart) is skipped.
        anyio.run(_announce_again, nats_url)
        spare = [str(uuid.uuid4())]
        manager.generate_sequences(_prompts(spare, 3))
        wait_until(lambda: manager.skipped_again == 1, timeout=30, what="the repeated manifest skipped")
        assert manager.groups_placed == GROUPS
        assert tq.kv_list("train")["train"][spare[0]]["status"] == "running"  # waits for a new batch

        tags = tq.kv_list("train")["train"]
        assert all(tags[u]["status"] == "finished" for u in first + rest)
        keys = sorted(k for k in tags if "_" in k)
        data = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=["trajectory_id"])
        placed = list(data["trajectory_id"])
        emitted = {t.trajectory_id for t in read_trajectories(nats_url)}
        assert sorted(placed) == sorted(emitted) and len(set(placed)) == 2 * GROUPS
    finally:
        manager.close()
        tq.close()


async def _announce_again(url: str) -> None:
    """Publish the first batch's manifest once more (under another message id, past deduplication)."""
    import nats as nats_client

    nc = await nats_client.connect(url)
    try:
        js = nc.jetstream()
        first = await js.get_msg("SG_BATCHES", 1)
        await js.publish(first.subject, first.data or b"", headers={"Nats-Msg-Id": "again"})
    finally:
        await nc.close()


def test_another_rollout_name_is_refused(tiny_model_path: Path, tmp_path: Path) -> None:
    from consumers.verl_v1 import StreamAgentLoopManagerTQ

    config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": "vllm"}}})
    with pytest.raises(ValueError, match=r"rollout\.name=stream_gateway"):
        StreamAgentLoopManagerTQ.create(config=config)
