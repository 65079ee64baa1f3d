"""The verl adapter against a real nats-server and verl 0.9.1's own trainer-side code.

Batches come from a real :class:`~consumers.batcher.Batcher`; the "trainer" is the part of
``RayPPOTrainer.fit`` around ``generate_sequences`` (verl's ``_get_gen_batch``, ``repeat``,
``union``, ``extract_reward``, ``compute_grpo_outcome_advantage``), which runs here on CPU.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import torch

from consumers.batcher import Batcher
from consumers.parquet import decode_batch
from consumers.trajectory import Trajectory
from consumers.verl_adapter import StreamAgentLoopManager, StreamSettings
from consumers.verl_batch import padded_batch, to_data_proto
from pipeline.embedded import EmbeddedNatsServer

from ..support.trajectories import make_trajectory
from .test_batcher import (
    batcher_config,
    jetstream,
    publish,
    read_manifests,
    read_object,
    unique_names,
    wait_until,
)

pytestmark = pytest.mark.anyio

YAML = """\
hydra:
  searchpath:
    - pkg://verl.trainer.config

defaults:
  - ppo_trainer
  - _self_

data:
  max_prompt_length: 16
  max_response_length: 32

actor_rollout_ref:
  rollout:
    name: vllm
    agent:
      agent_loop_manager_class: consumers.verl_adapter.StreamAgentLoopManager
    custom:
      stream_gateway:
        nats_url: nats://10.0.0.5:4222
        durable: trainer-a
        timeout_s: 900
        pad_token_id: 7
        batches: MY_BATCHES
"""


def _trainer_request(prompts: int, n: int) -> tuple[Any, Any]:
    """What ``RayPPOTrainer.fit`` passes to ``generate_sequences``, built by verl's own code."""
    from verl.protocol import DataProto

    with warnings.catch_warnings():  # ray's deprecated ray.experimental, verl's missing optional engines
        warnings.simplefilter("ignore")
        from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    batch = DataProto.from_single_dict(
        {
            "dummy_tensor": torch.zeros(prompts, 1, dtype=torch.uint8),
            "data_source": np.array(["stream"] * prompts, dtype=object),
            "raw_prompt": np.array([[{"role": "user", "content": "hi"}]] * prompts, dtype=object),
            "index": np.arange(prompts),
        }
    )
    batch.non_tensor_batch["uid"] = np.array([str(uuid.uuid4()) for _ in range(prompts)], dtype=object)
    gen_batch = RayPPOTrainer._get_gen_batch(None, batch)  # type: ignore[arg-type]  # it does not use self
    gen_batch.meta_info["global_steps"] = 1
    return batch, gen_batch.repeat(repeat_times=n, interleave=True)


async def test_generate_sequences_returns_the_next_batch_in_the_trainers_step(
    nats_server: EmbeddedNatsServer,
) -> None:
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage
    from verl.trainer.ppo.reward import extract_reward

    rng = random.Random(7)
    names = unique_names()
    groups = [[make_trajectory(rng, group=f"g{i}", reward=float(j)) for j in range(2)] for i in range(4)]
    settings = StreamSettings(
        nats_url=nats_server.url, names=names, prompt_length=16, response_length=32, pad_token_id=0, timeout_s=20
    )
    with anyio.fail_after(60):
        async with jetstream(nats_server.url, names) as (nc, js):
            async with anyio.create_task_group() as tg:
                batcher = Batcher(batcher_config(nats_server.url, names, batch_size=4, group_size=2))
                await tg.start(batcher.run)
                await publish(nc, js, names, *[t for group in groups for t in group])
                await wait_until(lambda: batcher.statistics().batches == 2)
                manifests = [m for _, m in await read_manifests(js, names)]
                tg.cancel_scope.cancel()

            short = dataclasses.replace(settings, prompt_length=8)
            with StreamAgentLoopManager(settings=short) as manager:
                # A trainer padding shorter than the batcher cut: said up front, naming both settings.
                _, request = _trainer_request(prompts=2, n=2)
                with pytest.raises(ValueError, match=r"cut for prompts of up to 16 .* pads to 8 and 32"):
                    await anyio.to_thread.run_sync(manager.generate_sequences, request)

            with StreamAgentLoopManager(settings=settings) as manager:
                # A trainer whose step does not match the batch: a clear error, and the batch stays.
                _, wrong = _trainer_request(prompts=4, n=2)
                with pytest.raises(ValueError, match="set the batcher's batch_size to 8"):
                    await anyio.to_thread.run_sync(manager.generate_sequences, wrong)

                for manifest in manifests:
                    batch, request = _trainer_request(prompts=2, n=2)
                    output = await anyio.to_thread.run_sync(manager.generate_sequences, request)
                    assert output.meta_info["sg_batch_id"] == manifest.batch_id
                    assert list(output.non_tensor_batch["trajectory_id"]) == manifest.trajectory_ids

                    # The tensors are the batch's padded layout.
                    trajectories, uids = decode_batch(await read_object(js, manifest))
                    expected = to_data_proto(
                        padded_batch(trajectories, uids, prompt_length=16, response_length=32, pad_token_id=0)
                    )
                    for key in ("prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids"):
                        assert torch.equal(output.batch[key], expected.batch[key]), key
                    for key in ("rollout_log_probs", "rm_scores"):
                        assert torch.equal(output.batch[key], expected.batch[key]), key
                    assert output.batch["input_ids"].shape == (4, 48) and output.batch["responses"].shape == (4, 32)
                    assert list(output.non_tensor_batch["sg_group_uid"]) == uids

                    # The trainer's own next steps accept it.
                    timing = output.meta_info.pop("timing")
                    assert timing["stream/wait_s"] >= 0
                    batch = batch.repeat(repeat_times=2, interleave=True).union(output)
                    assert [len(m) for m in batch.non_tensor_batch["multi_modal_inputs"]] == [0] * 4
                    reward_tensor, _ = extract_reward(batch)
                    advantages, _ = compute_grpo_outcome_advantage(
                        token_level_rewards=reward_tensor,
                        response_mask=batch.batch["response_mask"],
                        index=batch.non_tensor_batch["uid"],
                    )
                    # Rewards 0 and 1 in every group of two: GRPO gives -+0.7071 on the sampled tokens.
                    per_row = (advantages * batch.batch["response_mask"]).sum(-1) / batch.batch["response_mask"].sum(-1)
                    assert torch.allclose(per_row, torch.tensor([-0.7071, 0.7071] * 2), atol=1e-3)

            info = await js.consumer_info(names.batches, settings.durable)
            assert (info.num_ack_pending, info.num_pending, info.delivered.stream_seq) == (0, 0, 2)


async def test_no_batch_waits_with_a_clear_message_then_times_out(
    nats_server: EmbeddedNatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    names = unique_names()
    # The wait polls NATS once a second and logs at most once per poll: three seconds leave room
    # for two messages however slowly the first poll (which also connects) comes back.
    settings = StreamSettings(nats_url=nats_server.url, names=names, timeout_s=3.0, log_every_s=0.4)
    caplog.set_level(logging.WARNING, logger="consumers.verl_adapter")
    async with jetstream(nats_server.url, names) as (_, js):  # a manifest nobody can read is skipped
        await js.publish(names.batch_subject, b"not a manifest", headers={"Nats-Msg-Id": "garbage"})
    with StreamAgentLoopManager(settings=settings) as manager:
        started = time.monotonic()
        with pytest.raises(TimeoutError, match=f"no training batch from NATS at {nats_server.url}"):
            await anyio.to_thread.run_sync(manager.generate_sequences)
        assert time.monotonic() - started >= settings.timeout_s  # it gave up only once the whole timeout was spent
    assert any(r.getMessage().startswith("skipping batch manifest 1:") for r in caplog.records)
    waiting = [r.getMessage() for r in caplog.records if "waiting for a batch" in r.getMessage()]
    assert len(waiting) >= 2
    assert waiting[0].startswith(f"waiting for a batch from NATS at {nats_server.url} (stream {names.batches}")


async def test_a_trainer_of_one_adapter_serves_only_that_adapters_batches(nats_server: EmbeddedNatsServer) -> None:
    """One batcher of every adapter; a trainer of alpha and a trainer of the base each take theirs,
    on consumers of their own, and acknowledge the other's there."""
    rng = random.Random(8)
    names = unique_names()
    alpha = [
        Trajectory.model_validate(make_trajectory(rng, group=f"a{i}", version=4).model_dump() | {"adapter": "alpha"})
        for i in range(4)
    ]
    base = [make_trajectory(rng, group=f"b{i}") for i in range(2)]
    common = {"nats_url": nats_server.url, "names": names, "prompt_length": 16, "response_length": 32}
    trainers = {
        "alpha": StreamSettings(**common, only_adapter="alpha", timeout_s=20),
        None: StreamSettings(**common, only_base=True, timeout_s=20),
    }
    assert [s.consumer_name for s in trainers.values()] == ["verl-trainer-adapter-alpha", "verl-trainer-base"]
    with anyio.fail_after(90):
        async with jetstream(nats_server.url, names) as (nc, js):
            async with anyio.create_task_group() as tg:
                batcher = Batcher(batcher_config(nats_server.url, names, batch_size=2))
                await tg.start(batcher.run)
                await publish(nc, js, names, alpha[0], base[0], alpha[1], alpha[2], base[1], alpha[3])
                await wait_until(lambda: batcher.statistics().batches == 3)
                manifests = [m for _, m in await read_manifests(js, names)]
                tg.cancel_scope.cancel()
            assert [m.adapter for m in manifests] == ["alpha", None, "alpha"]

            for adapter, settings in trainers.items():
                ours = [m for m in manifests if m.adapter == adapter]
                with StreamAgentLoopManager(settings=settings) as manager:
                    for manifest in ours:
                        output = await anyio.to_thread.run_sync(manager.generate_sequences)
                        assert output.meta_info["sg_batch_id"] == manifest.batch_id
                        assert list(output.non_tensor_batch["adapter"]) == [adapter] * 2
                # Read up to its last batch, the other adapter's on the way acknowledged.
                last = max(seq for seq, m in enumerate(manifests, 1) if m.adapter == adapter)
                info = await js.consumer_info(names.batches, settings.consumer_name)
                assert (info.num_ack_pending, info.num_pending, info.delivered.stream_seq) == (0, 3 - last, last)

            # Nothing more of alpha: it waits and says for which adapter.
            short = StreamSettings(**common, only_adapter="alpha", timeout_s=0.5, log_every_s=0.2)
            with StreamAgentLoopManager(settings=short) as manager, pytest.raises(TimeoutError) as raised:
                await anyio.to_thread.run_sync(manager.generate_sequences)
            assert "durable consumer verl-trainer-adapter-alpha" in str(raised.value)
            assert "no batch of adapter 'alpha' was published" in str(raised.value)
    with pytest.raises(ValueError, match="only_adapter and only_base exclude each other"):
        StreamSettings(only_adapter="alpha", only_base=True)
    configured = StreamSettings.from_verl_config(
        {"actor_rollout_ref": {"rollout": {"custom": {"stream_gateway": {"only_adapter": "beta", "pad_token_id": 0}}}}}
    )
    assert configured.consumer_name == "verl-trainer-adapter-beta"


def test_without_nats_it_builds_and_times_out_saying_nats_is_unavailable() -> None:
    settings = StreamSettings(nats_url="nats://127.0.0.1:1", timeout_s=1.0, connect_timeout_s=0.2)
    with StreamAgentLoopManager(settings=settings) as manager, pytest.raises(TimeoutError, match="NATS unavailable"):
        manager.generate_sequences()


def test_validation_requests_are_refused() -> None:
    from verl.protocol import DataProto

    manager = StreamAgentLoopManager(settings=StreamSettings())
    request = DataProto.from_single_dict({"x": torch.zeros(2, 1)}, meta_info={"validate": True})
    with pytest.raises(NotImplementedError, match="test_freq=-1"):
        manager.generate_sequences(request)
    manager.close()


def test_configured_from_a_verl_config_as_the_trainer_loads_it(tmp_path: Path) -> None:
    """The YAML of the docs, composed by Hydra over verl's ppo_trainer, loaded as verl's trainer does."""
    from hydra import compose, initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.import_utils import load_class_from_fqn

    (tmp_path / "stream.yaml").write_text(YAML)
    with initialize_config_dir(config_dir=str(tmp_path), version_base=None):
        config = compose(config_name="stream")
    rollout = config.actor_rollout_ref.rollout
    assert (
        omega_conf_to_dataclass(rollout).custom["stream_gateway"]["durable"] == "trainer-a"
    )  # verl's schema accepts it
    cls = load_class_from_fqn(rollout.get("agent", {}).get("agent_loop_manager_class"), "AgentLoopManager")
    manager = cls.create(config=config, llm_client=None, teacher_client=None, reward_loop_worker_handles=None)
    assert isinstance(manager, StreamAgentLoopManager)
    s = manager.settings
    assert (s.nats_url, s.durable, s.timeout_s, s.pad_token_id) == ("nats://10.0.0.5:4222", "trainer-a", 900, 7)
    assert (s.prompt_length, s.response_length, s.names.batches) == (16, 32, "MY_BATCHES")
    with pytest.raises(ValueError, match="unknown stream_gateway settings"):
        StreamSettings.from_verl_config({"actor_rollout_ref": {"rollout": {"custom": {"stream_gateway": {"x": 1}}}}})
