"""The gateway pool as verl's rollout: ``actor_rollout_ref.rollout.name=stream_gateway``.

verl 0.9.1's v1 trainers (``verl/trainer/ppo/v1/trainer_base.py``) always build rollout replicas
and a checkpoint engine manager that sends them weights. With ``vllm`` or ``sglang`` those are
engines on the training nodes (sync, hybrid) or on devices of their own (separate-async,
standalone) that a trainer fed by the stream never asks for a token. Under the name
``stream_gateway`` they are this module's classes instead, which hold no device and no engine:

* :class:`StreamGatewayReplica` (verl's ``RolloutReplica``, looked up by
  ``verl.workers.rollout.replica.get_rollout_replica_class``) launches no server. Its standalone
  form (separate-async) starts one CPU Ray actor, verl's own ``CheckpointEngineWorker``, because
  verl's non-naive weight sync (``CheckpointEngineManager.update_weights``,
  ``verl/checkpoint_engine/base.py``) builds a worker group of every replica's workers and
  cannot build one of none. Sleep, wake-up, abort and the KV-cache calls reach no server: gateways
  serve live users through training and swap weights between two decode steps.
* :class:`StreamGatewayRollout` (verl's ``BaseRollout``, looked up by
  ``verl.workers.rollout.base.get_rollout_class``) is what verl hands the weights to. In the sync
  trainer (hybrid, ``checkpoint_engine.backend`` forced to ``naive`` by ``trainer_base.py``) each
  actor rank calls ``self.rollout.update_weights(per_tensor_param, peft_config=,
  base_sync_done=, global_steps=)`` (``ActorRolloutRefWorker.update_weights``,
  ``verl/workers/engine_workers.py``): every rank drains the tensors, rank 0 publishes them on
  NATS as policy version ``global_steps`` (:class:`consumers.verl_weights.NatsCheckpointEngine`,
  configured from ``rollout.checkpoint_engine.engine_kwargs.nats``). In the separate-async trainer
  the actor ranks' own ``nats`` checkpoint engine publishes, and this class, in the replica's
  worker, receives nothing and passes nothing on.

Both are registered under :data:`ROLLOUT_NAME` when this module is imported. verl imports it
itself: the package declares it as a ``verl.plugins`` entry point, which ``verl/__init__.py``
loads in every process that imports verl (unless ``VERL_USE_EXTERNAL_PLUGINS=none``), and the
documented configuration also names it in ``actor_rollout_ref.model.external_lib``, which
``HFModelConfig.__post_init__`` imports wherever verl builds the model config, before any replica
is looked up; unlike a plugin (logged at debug level when it fails), that import fails loudly.
:func:`register` is idempotent.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterable, Iterable
from typing import Any

import torch
from verl.single_controller.ray import RayResourcePool, RayWorkerGroup
from verl.workers.rollout import base as _rollout_base
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutMode, RolloutReplica, RolloutReplicaRegistry

from .verl_weights import BACKEND, NatsCheckpointEngine

__all__ = ["ROLLOUT_NAME", "StreamGatewayReplica", "StreamGatewayRollout", "register"]

ROLLOUT_NAME = "stream_gateway"

log = logging.getLogger(__name__)


class StreamGatewayRollout(BaseRollout):
    """What verl hands weights to: publishes them on NATS from rank 0 (module docstring)."""

    def __init__(self, config: Any, model_config: Any, device_mesh: Any = None, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, model_config, device_mesh)
        self.replica_rank = int(kwargs.get("replica_rank", 0))  # read by CheckpointEngineWorker.get_replica_rank
        self.is_leader_rank = True
        options = self.config.checkpoint_engine.engine_kwargs.get(BACKEND) or {}
        self._engine = NatsCheckpointEngine(is_master=_rank() == 0, **dict(options))

    async def resume(self, tags: list[str]) -> None:
        """Nothing: no weights or KV cache are held here."""

    async def release(self) -> None:
        """Nothing: no weights or KV cache are held here."""

    async def update_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]] | AsyncIterable[tuple[str, torch.Tensor]],
        wire_format: str = "named_tensors",
        **kwargs: Any,
    ) -> None:
        """Publish ``weights`` as version ``global_steps`` (rank 0, after every rank drained them).

        Version 0 (the weights gateways start with) and a LoRA base sync (``base_sync_done=False``:
        the gateways hold the base) are drained and not published.
        """
        if wire_format != "named_tensors":
            raise ValueError(
                f"the {ROLLOUT_NAME} rollout takes full tensors (wire_format named_tensors), not {wire_format!r}: "
                f"use checkpoint_engine.backend={BACKEND}"
            )
        global_steps = kwargs.get("global_steps")
        if global_steps is None or global_steps < 1 or not kwargs.get("base_sync_done", True):
            await _drain(weights)  # the collectives inside the generator need every rank
            return
        metrics = await self._engine.send_weights(weights, int(global_steps), peft_config=kwargs.get("peft_config"))
        if metrics:
            log.info("weights of step %d: %s", global_steps, metrics)


class StreamGatewayReplica(RolloutReplica):
    """verl's rollout replica for the gateway pool: no server, no device (module docstring)."""

    async def launch_servers(self) -> None:
        """No server: the gateways run on their own, outside Ray."""
        self.servers = []
        self._server_address = f"{ROLLOUT_NAME}-{self.replica_rank}"
        self._server_handle = None  # type: ignore[assignment]  # no server: nothing to hand out

    async def init_standalone(self) -> None:
        """One CPU worker (verl's ``CheckpointEngineWorker``) in place of an engine on devices of its own."""
        self.rollout_mode = RolloutMode.STANDALONE
        name = f"{ROLLOUT_NAME}_standalone_{self.replica_rank}{self.name_suffix}"
        self.resource_pool = RayResourcePool(
            process_on_nodes=[1], use_gpu=False, name_prefix=name, max_colocate_count=1
        )
        group = RayWorkerGroup(
            resource_pool=self.resource_pool,
            ray_cls_with_init=self.get_ray_class_with_init_args(),
            bin_pack=False,
            name_prefix=name,
            use_gpu=False,
            device_name="cpu",
        )
        self.workers = group.workers
        await self.launch_servers()

    def rollout_worker_use_gpu(self) -> bool:
        return False


def register() -> None:
    """Register :data:`ROLLOUT_NAME` with verl's two rollout registries (idempotent)."""
    RolloutReplicaRegistry.register(ROLLOUT_NAME, lambda: StreamGatewayReplica)
    _rollout_base._ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = f"{__name__}.StreamGatewayRollout"


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


async def _drain(weights: Iterable[tuple[str, torch.Tensor]] | AsyncIterable[tuple[str, torch.Tensor]]) -> None:
    if isinstance(weights, AsyncIterable):
        async for _ in weights:
            pass
    else:
        for _ in weights:
            pass


register()
