"""verl 0.9.1's v1 trainers on a CPU: everything of theirs, except the worker groups that need a GPU.

What is replaced, and only that: ``PPOTrainer._setup``'s resource pools and FSDP/Megatron worker
groups (``RayWorkerGroup`` of ``ActorRolloutRefWorker`` on GPU bundles) become :class:`CpuActor`, a
plain object with the worker group's methods the v1 trainers call (``compute_log_prob``,
``update_actor``, ``update_weights``, ``execute_checkpoint_engine``, the separate-async trainer's
``save_model_to_cpu``/``restore_model_from_cpu``/``clear_cpu_model``), running the real tiny model
with torch on the CPU: a forward pass for the log-probs, one SGD step of the clipped policy
gradient for the update, its weights handed to verl's rollout (``consumers.verl_rollout``) or
to the ``nats`` checkpoint engine exactly as ``ActorRolloutRefWorker.update_weights`` hands them.
The rest of ``_setup`` runs as verl wrote it: the tokenizer, the dataloader over the configured
dataset, verl's ``RewardLoopManager`` (CPU Ray actors), ``LLMServerManager.create`` with the
configured rollout's replicas, ``CheckpointEngineManager`` and ``_load_checkpoint``. ``fit``,
``step``, the replay buffer, advantages, rollout correction and metrics are verl's own.

:func:`cpu_trainers` swaps these classes in for the ``sync`` and ``separate_async`` entries of
verl's trainer registry (``verl.trainer.ppo.v1.trainer_base.TRAINER_REGISTRY``), so the config
keeps its ``trainer.v1.trainer_mode``. Every update's batch, as the actor received it from
TransferQueue, is kept in :attr:`CpuActor.seen` (in the process that runs the trainer: the tests'
Ray child, tests/support/ray_child.py), each field as a list of rows.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import ray
import torch
from omegaconf import OmegaConf

log = logging.getLogger(__name__)


class CpuActor:
    """The actor worker group's methods, on one CPU process (dp size 1): see the module docstring."""

    world_size = 1
    seen: ClassVar[list[dict[str, Any]]] = []  # every update_actor's batch, across trainers (tests read it)
    published: ClassVar[list[int]] = []  # steps whose weights were handed on

    def __init__(self, config: Any) -> None:
        from transformers import AutoModelForCausalLM

        self.config = config
        self.model = AutoModelForCausalLM.from_pretrained(config.actor_rollout_ref.model.path, dtype=torch.float32)
        self.model.eval()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-2)
        self._dispatch_info: dict[str, list[int]] = {}
        self._saved: dict[int, dict[str, torch.Tensor]] = {}
        self.workers: list[Any] = []
        self._rollout: Any = None

    def _query_dispatch_info(self, role: str) -> list[int]:
        return [0]

    def _forward(self, input_ids: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-position log-prob of the next id and entropy, over one unpadded sequence (left-shifted, as verl's)."""
        logits = self.model(input_ids.unsqueeze(0)).logits[0].float() / temperature
        logp = torch.log_softmax(logits, dim=-1)
        chosen = logp[:-1].gather(-1, input_ids[1:].unsqueeze(-1)).squeeze(-1)
        entropy = -(logp.exp() * logp).sum(-1)[:-1]
        pad = chosen.new_zeros(1)
        return torch.cat([chosen, pad]), torch.cat([entropy, pad])

    def compute_log_prob(self, batch: Any) -> Any:
        import transfer_queue as tq
        from tensordict import TensorDict

        temperature = float(batch.extra_info.get("temperature", 1.0))
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["input_ids"])
        logps, entropies = [], []
        with torch.no_grad():
            for ids in data["input_ids"].unbind():
                logp, entropy = self._forward(ids, temperature)
                logps.append(logp)
                entropies.append(entropy)
        nested = {
            "log_probs": torch.nested.as_nested_tensor(logps, layout=torch.jagged),
            "entropy": torch.nested.as_nested_tensor(entropies, layout=torch.jagged),
        }
        tq.kv_batch_put(
            keys=batch.keys, partition_id=batch.partition_id, fields=TensorDict(nested, batch_size=len(logps))
        )
        return batch

    def update_actor(self, batch: Any) -> dict[str, Any]:
        import transfer_queue as tq

        fields = ["uid", "input_ids", "responses", "response_mask", "rollout_log_probs", "old_log_probs",
                  "advantages", "rm_scores", "policy_versions", "trajectory_id"]  # fmt: skip
        optional = ["rollout_is_weights"]
        present = set(tq.kv_batch_get(keys=batch.keys[:1], partition_id=batch.partition_id).keys())
        data = tq.kv_batch_get(
            keys=batch.keys,
            partition_id=batch.partition_id,
            select_fields=fields + [f for f in optional if f in present],
        )
        padding = [bool(tag.get("is_padding", False)) for tag in batch.tags]
        rows = {field: _rows(data[field]) for field in data.keys()}  # noqa: SIM118 (a TensorDict)
        CpuActor.seen.append({"keys": list(batch.keys), "padding": padding, "data": rows, "tags": list(batch.tags)})
        temperature = float(batch.extra_info.get("temperature", 1.0))
        clip = 0.2
        self.model.train()
        self.optimizer.zero_grad()
        losses = []
        for i, ids in enumerate(data["input_ids"].unbind()):
            if padding[i]:
                continue
            mask = data["response_mask"][i].float()
            n = mask.numel()
            logp, _ = self._forward(ids, temperature)
            new = logp[-n - 1 : -1]
            ratio = torch.exp(new - data["old_log_probs"][i])
            advantage = data["advantages"][i]
            surrogate = torch.minimum(ratio * advantage, torch.clamp(ratio, 1 - clip, 1 + clip) * advantage)
            losses.append(-(surrogate * mask).sum() / mask.sum().clamp(min=1))
        loss = torch.stack(losses).mean()
        loss.backward()
        self.optimizer.step()
        self.model.eval()
        return {"metrics": {"pg_loss": [float(loss)], "mfu": [0.0]}}

    # -- weights ----------------------------------------------------------------------------

    def _tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.model.state_dict().items():
            yield name, tensor.detach()

    def update_weights(self, global_steps: int | None = None, mode: str = "auto") -> list[Any]:
        """``ActorRolloutRefWorker.update_weights``: ``naive`` hands the tensors to the rollout,
        another mode to the checkpoint engine's ``send_weights``."""
        rollout_config = self.config.actor_rollout_ref.rollout
        if mode == "naive":
            if self._rollout is None:
                from verl.workers.rollout.base import get_rollout_class

                cls = get_rollout_class(rollout_config.name, rollout_config.mode)
                self._rollout = cls(config=rollout_config, model_config=self.config.actor_rollout_ref.model)
            call = self._rollout.update_weights(self._tensors(), peft_config=None, base_sync_done=True,
                                                global_steps=global_steps)  # fmt: skip
        else:
            from verl.checkpoint_engine.base import CheckpointEngineRegistry
            from verl.utils.import_utils import import_external_libs

            engine_config = rollout_config.checkpoint_engine
            import_external_libs(engine_config.custom_backend_module or None)
            kwargs = OmegaConf.to_container(engine_config.engine_kwargs.get(engine_config.backend, {}))
            engine = CheckpointEngineRegistry.new(engine_config.backend, is_master=True, **kwargs)  # type: ignore[arg-type]
            call = engine.send_weights(self._tensors(), global_steps=global_steps)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # verl calls from inside its own asyncio.run
            result = pool.submit(asyncio.run, call).result() or {}
        if global_steps:
            CpuActor.published.append(int(global_steps))
        return [ray.put(result)]

    def execute_checkpoint_engine(self, method: Any = None, *args: Any, **kwargs: Any) -> list[Any]:
        return [ray.put({})]  # the nats engine has no process group to prepare, build or finalize

    def save_model_to_cpu(self, n: int) -> None:
        self._saved[n] = copy.deepcopy(self.model.state_dict())

    def restore_model_from_cpu(self, n: int) -> None:
        self.model.load_state_dict(self._saved[n])

    def clear_cpu_model(self, n: int) -> None:
        self._saved.pop(n, None)

    def start_profile(self, **kwargs: Any) -> None:
        pass

    def stop_profile(self, **kwargs: Any) -> None:
        pass


def _rows(value: Any) -> list[Any]:
    """One field of a TransferQueue batch as a list of its rows (a tensor each, or a Python value):
    what a test indexes, and what pickles back from the Ray child (a ``TensorDict`` of jagged
    tensors and non-tensor stacks may not)."""
    if isinstance(value, torch.Tensor):
        return [row.clone() for row in value.unbind(0)]
    return list(value.tolist() if hasattr(value, "tolist") else value)


class _CpuPools:
    """``ResourcePoolManager`` as far as the trainers read it after set-up."""

    def get_n_gpus(self) -> int:
        return 1


def _cpu_setup(self: Any) -> None:
    """``PPOTrainer._setup`` (verl 0.9.1, ``trainer_base.py``) with the GPU worker groups replaced."""
    from verl.checkpoint_engine import CheckpointEngineManager
    from verl.experimental.reward_loop import RewardLoopManager
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.rollout.llm_server import LLMServerManager

    self._init_tokenizer()
    self._init_dataloader()
    self._init_dump_executor()
    self.resource_pool_manager = _CpuPools()
    self.ref_in_actor = False
    self.actor_rollout_wg = CpuActor(self.config)
    self.reward_loop_manager = RewardLoopManager(config=self.config, rm_resource_pool=None)
    self.teacher_model_manager = None
    self.distillation_config = None
    if getattr(self, "_enable_hybrid_replicas", True):
        self.llm_server_manager = LLMServerManager.create(config=self.config, worker_group=self.actor_rollout_wg)
    else:
        self.llm_server_manager = LLMServerManager.create_empty(config=self.config)
    checkpoint_engine_config = omega_conf_to_dataclass(self.config.actor_rollout_ref.rollout.checkpoint_engine)
    checkpoint_engine_config.backend = "naive"
    self.checkpoint_manager = CheckpointEngineManager(
        config=checkpoint_engine_config, actor_wg=self.actor_rollout_wg, replicas=self.llm_server_manager.get_replicas()
    )
    self.checkpoint_manager.sleep_replicas()
    self._load_checkpoint()


@contextmanager
def cpu_trainers() -> Iterator[dict[str, type]]:
    """verl's ``sync`` and ``separate_async`` trainers with :func:`_cpu_setup`, registered under their own names."""
    from verl.trainer.ppo.v1 import PPOTrainer, PPOTrainerSeparateAsync, PPOTrainerSync
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY

    class CpuBase(PPOTrainer):
        _setup = _cpu_setup

    class CpuSync(PPOTrainerSync, CpuBase):
        pass

    class CpuSeparateAsync(PPOTrainerSeparateAsync, CpuBase):
        pass

    saved = dict(TRAINER_REGISTRY)
    TRAINER_REGISTRY.update(sync=CpuSync, separate_async=CpuSeparateAsync)
    CpuActor.seen.clear()
    CpuActor.published.clear()
    try:
        yield {"sync": CpuSync, "separate_async": CpuSeparateAsync}
    finally:
        TRAINER_REGISTRY.clear()
        TRAINER_REGISTRY.update(saved)
