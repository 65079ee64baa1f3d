"""verl's weight sync, through NATS: each trainer step's weights become a policy version.

verl 0.9.1's PPO trainer (``verl/trainer/ppo/ray_trainer.py``, ``RayPPOTrainer.init_workers``)
loads the class named by ``actor_rollout_ref.rollout.checkpoint_manager_class`` with
``load_class_from_fqn`` and builds it as ``cls(config=<CheckpointEngineConfig>,
actor_wg=<the actor RayWorkerGroup>, replicas=<verl's rollout replicas>)``. ``fit`` then calls,
synchronously, ``sleep_replicas()`` once at init and after every ``generate_sequences``, and
``update_weights(global_steps)`` once at start (``0``, or the step a checkpoint resumed) and
after every actor update (``1, 2, ...``). :class:`StreamCheckpointManager` is that class: its
``update_weights(k)`` publishes the actor's weights as policy version ``k`` on NATS
(:func:`pipeline.policies.publish_tensors`); every gateway following the stream applies them.

The weights never leave the actor workers except towards NATS. In verl 0.9.1 the actor worker
group has no method returning a state dict; the one path to the full HF-named weights is
``actor_wg.update_weights(global_steps=, mode=<backend>)`` (``verl/workers/engine_workers.py``,
``ActorRolloutRefWorker.update_weights``), which, for a mode other than ``naive``, runs on every
rank ``self.checkpoint_engine.send_weights(self.actor.engine.get_per_tensor_param()[0],
global_steps=)``. That ``checkpoint_engine`` is built in ``ActorRolloutRefWorker.init_model``
as ``CheckpointEngineRegistry.new(checkpoint_engine.backend, is_master=<rank 0>, bucket_size=,
**checkpoint_engine.engine_kwargs[backend])``, after importing
``checkpoint_engine.custom_backend_module``. So this module registers the backend ``nats``
(:class:`NatsCheckpointEngine`), and its ``engine_kwargs`` carry the NATS settings::

    actor_rollout_ref:
      rollout:
        checkpoint_manager_class: consumers.verl_weights.StreamCheckpointManager
        checkpoint_engine:
          backend: nats
          custom_backend_module: consumers.verl_weights
          engine_kwargs:
            nats:                              # every key optional (NatsWeightSettings)
              servers: [nats://10.0.0.5:4222]
              prefix: sg
              stream: SG_EVENTS
              bucket: sg_policies
              dtype: bfloat16                  # cast floating tensors before upload
              adapter: alpha                   # LoRA actor: publish adapter "alpha", not the model
              auth: {user: trainer, tls_ca: /etc/nats/ca.pem}   # pipeline.connection.NatsAuth; the
                                               #   password from $STREAM_GATEWAY_NATS_PASSWORD

LoRA (``engine_kwargs.nats.adapter: NAME``): the actor trains a LoRA adapter
(``actor_rollout_ref.model.lora_rank > 0``) and each step publishes that adapter, not the model,
as version ``global_steps`` of adapter ``NAME`` (:func:`publish_adapter`, through
:func:`pipeline.policies.publish_policy` with ``adapter=NAME``); the gateways keep serving their
base and swap that adapter's tensors. What verl 0.9.1 does with a LoRA actor, read for this
(paths under ``verl/``, lines of the installed 0.9.1):

* Configuration: ``workers/config/model.py`` ``HFModelConfig`` (122-135: ``lora_rank`` 0 = off,
  ``lora_alpha`` 16, ``target_modules`` "all-linear", ``exclude_modules``, ``lora_adapter_path``,
  and ``lora``, the Megatron dict whose ``merge`` the FSDP engine reads too;
  ``trainer/config/model/hf_model.yaml`` 43-55 and 101-106, ``lora.merge: False``).
* ``workers/engine/fsdp/transformer_impl.py``: ``FSDPEngine._build_lora_module`` (339-368) wraps
  the model with ``get_peft_model(module, LoraConfig(task_type=CAUSAL_LM, r=lora_rank,
  lora_alpha=lora_alpha, target_modules=, exclude_modules=, bias="none"))``, or loads
  ``PeftModel.from_pretrained(lora_adapter_path, is_trainable=True)``.
  ``get_per_tensor_param(layered_summon=False, base_sync_done=False)`` (977-1061) returns
  ``(tensors, peft_config.to_dict())`` for a LoRA actor with ``lora.merge`` false. With
  ``base_sync_done=True`` the tensors are ``collect_lora_params`` (``utils/fsdp_utils.py`` 715-789;
  645-712 with ``layered_summon``, one FSDP unit at a time): PEFT's ``get_peft_model_state_dict``,
  names ``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight``, gathered whole on CPU. With
  ``base_sync_done=False``, the default, they are the *base* weights only (``lora_`` tensors skipped,
  targeted modules renamed ``<module>.base_layer.weight`` by ``replace_lora_wrapper``, 792-817).
  With ``lora.merge`` true, the merged full model and the config ``None``.
* ``workers/engine/megatron/transformer_impl.py`` ``get_per_tensor_param`` (1033-1063): with
  ``base_sync_done=True``, ``bridge.export_adapter_weights`` and ``build_peft_config_for_vllm``
  (``utils/megatron_peft_utils.py`` 58-79: r, lora_alpha, ``target_modules="all-linear"``, bias none).
* ``workers/engine_workers.py`` ``ActorRolloutRefWorker.update_weights`` (728-826). The ``naive``
  path (verl's own colocated rollout, 785-806) asks ``base_sync_done=True`` for the adapter,
  preceded once by a ``base_sync_done=False`` base sync when the rollout started on dummy weights
  (``self.base_sync_done``, set in ``init_model``, 672-674). ``workers/rollout/vllm_rollout/utils.py``
  ``_update_weights`` (367-384) then loads the adapter tensors and config as
  ``TensorLoRARequest(lora_name=VLLM_LORA_NAME, lora_int_id=VLLM_LORA_INT_ID, lora_path=VLLM_LORA_PATH,
  peft_config=, lora_tensors=)`` (constants at 40-42) with ``add_lora``; ``utils/vllm/utils.py``
  (31-125) hijacks vLLM's ``_load_adapter`` to build the ``LoRAModel`` from those tensors. Any other
  mode (757-766) calls ``get_per_tensor_param()`` with no arguments, so a LoRA actor hands a
  checkpoint engine the base weights and no adapter; except ``mode="delta_sharded"`` (759-763), for
  which it calls ``checkpoint_engine.send_weights(self.actor.engine, global_steps=)``, handing over
  the training engine itself. With an adapter set, :class:`StreamCheckpointManager` calls
  ``update_weights(mode="delta_sharded")`` (:data:`ENGINE_MODE`); verl's ``delta_sharded`` engine is
  not involved (the engine is the one ``checkpoint_engine.backend`` built: this module's), and
  :meth:`NatsCheckpointEngine.send_weights` asks the training engine, on every rank, for
  ``get_per_tensor_param(layered_summon=, base_sync_done=True)``: the adapter tensors and config.
* The base is never asked for (``base_sync_done`` is always ``True``): gateways load it from their
  ``--model`` and share it between every adapter. A tensor that is not ``lora_A``/``lora_B`` in
  what arrives (a base weight) is left out of the adapter, with a log line saying how many.

Deliberate choices:

* **Every rank drains, rank 0 publishes, after draining.** ``get_per_tensor_param`` gathers full
  tensors with collectives (FSDP's ``full_tensor()``, Megatron's HF export), so every rank must
  iterate it to the end. Rank 0 copies each tensor to host memory; only when the iteration is
  over does it touch NATS, so a NATS failure cannot leave the other ranks stuck in a collective.
* **One adapter directory per step.** Rank 0 writes what ``save_pretrained`` would: the config
  verl's engine sends (sets as lists, ``inference_mode`` true) as ``adapter_config.json`` and the
  tensors as ``adapter_model.safetensors``, in a temporary directory, and publishes it with
  :func:`pipeline.policies.publish_policy` ``adapter=NAME``. Adapter versions are the adapter's own
  (the base's are untouched); a step not above the adapter's newest published version is skipped
  with a warning, as for the base.
* **Versions only go up.** Version ``0`` is the weights a gateway starts with: ``update_weights(0)``
  (a fresh start) publishes nothing. A step this manager already published is not sent again (the
  same step's second call: ``_validate``'s "wake up" with a colocated reward model). Before
  uploading, rank 0 reads the newest ``policy.updated`` on the stream and skips, with a warning,
  a version not above it (a resumed run re-sending its checkpoint's step): gateways would refuse
  it (``not_newer``), and re-uploading the same object names could race a gateway's download.
* **Replicas are left alone.** ``sleep_replicas``, ``wake_up_replicas``, ``abort_replicas``,
  ``resume_generation_replicas`` and the KV-cache pair do nothing: the gateways serving live users
  are not verl's replicas, never sleep, and swap weights between two decode steps. verl's own
  rollout replicas (``LLMServerManager.create`` launches them regardless) are not put to sleep
  either, so in hybrid mode they keep the GPU memory they hold (``rollout.gpu_memory_utilization``).
* **The events stream is the gateways'.** Rank 0 makes sure it exists, but a stream the gateways
  created keeps its replicas and limits: ``replicas`` (as ``publish-weights --stream-replicas``)
  unset changes no count, of the stream or of the ``sg_policies`` bucket (:mod:`pipeline.streams`).
* **Sync or awaited, as verl's default.** The async methods are wrapped in verl's own
  ``verl.utils.ray_utils.auto_await``, as ``verl.checkpoint_engine.base.CheckpointEngineManager``'s
  are: a plain call (``RayPPOTrainer`` calls synchronously) runs them with ``asyncio.run``, or in a
  worker thread when the calling thread already runs a loop; a coroutine can ``await`` them. The
  actor group's ``ObjectRef``s are awaited rather than ``ray.get``: nothing blocks a running loop.
* **Which trainers.** In verl 0.9.1 only ``RayPPOTrainer`` (``verl.trainer.main_ppo``) reads
  ``checkpoint_manager_class``. The v1 trainers (``verl/trainer/ppo/v1/trainer_base.py``) build
  verl's own manager: there the weights reach NATS through :mod:`consumers.verl_rollout` (sync: the
  rollout verl hands them to) and :class:`NatsCheckpointEngine` (separate-async: the actor ranks'
  engine, as here). The fully-async recipe (``FullyAsyncTrainer._setup_checkpoint_manager``) builds its own.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import re
import tempfile
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Coroutine, Iterable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, ParamSpec, Protocol, TypeVar, cast, runtime_checkable

import anyio
import torch
from pipeline.connection import NatsAuth, close_quietly, connect
from pipeline.errors import NatsRefused, StalePolicyVersion
from pipeline.events import PolicyUpdated, decode_event
from pipeline.policies import POLICY_BUCKET, newest_adapter_version, policy_subject, publish_policy, publish_tensors
from pipeline.streams import StreamSpec, ensure_stream
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry
from verl.utils.ray_utils import auto_await

from .errors import WeightPublishError

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.js import JetStreamContext
    from verl.workers.config import CheckpointEngineConfig
    from verl.workers.rollout import RolloutReplica

__all__ = [
    "BACKEND",
    "ENGINE_MODE",
    "ActorWorkerGroup",
    "NatsCheckpointEngine",
    "NatsWeightSettings",
    "StreamCheckpointManager",
    "TrainingEngine",
    "WeightPublishError",
    "publish_adapter",
    "publish_weights",
]

BACKEND = "nats"
# The update_weights mode for which verl 0.9.1's ActorRolloutRefWorker hands the checkpoint engine
# the training engine itself (send_weights(self.actor.engine, ...)): used with an adapter, so that
# the engine can ask for the LoRA tensors (base_sync_done=True), which no other mode yields.
ENGINE_MODE = "delta_sharded"
_ADAPTER_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")  # as pipeline.policies and the gateways accept
# A LoRA weight as PEFT names it (get_peft_model_state_dict drops the adapter name; a live module's
# state dict keeps it, ".lora_A.default.weight").
_LORA_KEY = re.compile(r"(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight")

log = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")

_CLOSE_TIMEOUT_S = 5.0

Weights = Iterable[tuple[str, torch.Tensor]] | AsyncIterable[tuple[str, torch.Tensor]]


def _auto_await(method: Callable[P, Coroutine[Any, Any, T]]) -> Callable[P, Any]:
    """verl's ``auto_await`` (untyped): the result, or the coroutine when the caller awaits it."""
    return cast("Callable[P, Any]", auto_await(method))  # type: ignore[no-untyped-call]


class ActorWorkerGroup(Protocol):
    """What this manager uses of verl's actor ``RayWorkerGroup``.

    ``update_weights`` is bound at runtime from ``ActorRolloutRefWorker.update_weights``
    (``@register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)``): one ``ObjectRef`` per rank.
    """

    def update_weights(self, *, global_steps: int, mode: str) -> list[Awaitable[Any]]:
        """Run the worker method on every rank; what each returns, to await."""
        ...


@runtime_checkable
class TrainingEngine(Protocol):
    """verl's training engine (``FSDPEngine``, ``MegatronEngine``), given to ``send_weights`` in ENGINE_MODE."""

    def get_per_tensor_param(self, **kwargs: Any) -> tuple[Any, dict[str, Any] | None]:
        """The weights (an iterable of ``(name, tensor)``) and, for a LoRA actor, its PEFT config dict."""
        ...


@dataclass(frozen=True, slots=True)
class NatsWeightSettings:
    """Where policies go: verl's ``checkpoint_engine.engine_kwargs.nats``, every key optional."""

    servers: tuple[str, ...] = ("nats://127.0.0.1:4222",)
    auth: NatsAuth = field(default_factory=NatsAuth)  # credentials and TLS (pipeline.connection)
    prefix: str = "sg"  # subject prefix of the events stream, as the gateways'
    stream: str = "SG_EVENTS"  # the events stream that holds policy.updated
    bucket: str = POLICY_BUCKET
    # As publish-weights' --stream-replicas: None leaves the stream's and the bucket's count as they are.
    replicas: int | None = None
    keep_full: int = 2  # full versions kept in the bucket (older objects are deleted)
    model: str = ""  # informational, copied into policy.updated
    dtype: str | None = None  # e.g. "bfloat16": floating tensors are cast before upload; None keeps the trainer's
    connect_timeout_s: float = 10.0
    publish_timeout_s: float = 1800.0  # one whole upload plus its event
    adapter: str | None = None  # LoRA: publish the actor's adapter as this adapter's versions, not the model
    layered_summon: bool = False  # LoRA on FSDP: gather the adapter one FSDP unit at a time (as rollout.layered_summon)

    def __post_init__(self) -> None:
        if not self.servers:
            raise ValueError("servers: at least one NATS URL")
        if self.keep_full < 1:
            raise ValueError("keep_full must be >= 1")
        if self.adapter is not None and not _ADAPTER_NAME.fullmatch(self.adapter):
            raise ValueError(f"adapter {self.adapter!r}: 1-128 of A-Z a-z 0-9 _ . -")
        self.torch_dtype()  # fail at construction, not at the first step
        _ = self.spec  # replicas out of 1-5 likewise

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None = None) -> NatsWeightSettings:
        """Settings from ``engine_kwargs.nats`` (a dict or an OmegaConf node); ``servers`` may be a comma list."""
        values = dict(options or {})
        known = {f.name for f in fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"unknown {BACKEND} checkpoint engine settings {sorted(unknown)}; known: {sorted(known)}")
        servers = values.get("servers")
        if isinstance(servers, str):
            values["servers"] = tuple(s.strip() for s in servers.split(",") if s.strip())
        elif servers is not None:
            values["servers"] = tuple(str(s) for s in servers)
        if "auth" in values and not isinstance(values["auth"], NatsAuth):
            values["auth"] = NatsAuth.from_options(values["auth"])
        return cls(**values)

    @property
    def spec(self) -> StreamSpec:
        """The events stream, as :func:`pipeline.policies.publish_policy` takes it."""
        return StreamSpec(prefix=self.prefix, stream=self.stream, replicas=self.replicas)

    def torch_dtype(self) -> torch.dtype | None:
        """``dtype`` as a torch floating dtype (``None``: keep each tensor's)."""
        if self.dtype is None:
            return None
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"dtype {self.dtype!r} is not a torch floating dtype (e.g. 'bfloat16')")
        return dtype


@CheckpointEngineRegistry.register(BACKEND)
class NatsCheckpointEngine(CheckpointEngine):
    """The ``nats`` checkpoint engine: built by verl on every actor rank (and rollout worker).

    Only ``send_weights`` does anything; there is no process group (``prepare``,
    ``init_process_group`` and ``finalize`` are no-ops) and nothing to receive: gateways read NATS.
    """

    def __init__(self, bucket_size: int = 0, is_master: bool = False, **options: Any) -> None:
        # bucket_size is verl's transfer bucket (update_weights_bucket_megabytes): uploads chunk on their own.
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.settings = NatsWeightSettings.from_options(options)

    def prepare(self) -> dict[str, Any]:
        """No topology to prepare."""
        return {}

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """No process group: nothing to dispatch."""
        return {}, {}

    def init_process_group(self, **kwargs: Any) -> None:
        """No process group."""

    def finalize(self) -> None:
        """Nothing held between steps."""

    async def send_weights(
        self,
        weights: Weights | TrainingEngine,
        global_steps: int | None = None,
        peft_config: Mapping[str, Any] | None = None,
    ) -> dict[str, float]:
        """Drain ``weights`` (every rank must); rank 0 then publishes them as version ``global_steps``.

        ``weights`` is what verl's ``update_weights`` hands over: the per-tensor iterable, or with
        :data:`ENGINE_MODE` the training engine, asked here for its weights (with an adapter, for the
        LoRA tensors and config: ``base_sync_done=True``). With an adapter, rank 0 publishes the
        adapter (:func:`publish_adapter`). ``peft_config`` is the adapter's config when ``weights``
        are an adapter's tensors handed over directly (verl's naive path, :mod:`consumers.verl_rollout`).
        Nothing is published when no tensor arrives (a rollout worker's empty receive). Returns
        metrics for the trainer (``stream/*``; empty on other ranks).
        """
        items, exported_config = self._exported(weights)
        peft_config = exported_config if exported_config is not None else peft_config
        if not self.is_master:
            async for _ in _items(items):
                pass  # the collectives inside the generator need every rank
            return {}
        started = time.monotonic()
        tensors = await _collect(items, self.settings.torch_dtype())
        if global_steps is None:
            raise ValueError("send_weights needs global_steps: it is the policy version")
        collect_s = time.monotonic() - started
        if not tensors:
            log.info("version %d: no weights arrived here, nothing published", global_steps)
            return {}
        if self.settings.adapter is not None:
            tensors = _adapter_tensors(tensors, self.settings.adapter)
            event = await publish_adapter(self.settings, tensors, peft_config, global_steps)
        else:
            event = await publish_weights(self.settings, tensors, global_steps)
        if event is None:
            return {"stream/policy_version_skipped": float(global_steps)}
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        return {
            "stream/policy_version": float(global_steps),
            "stream/collect_s": collect_s,
            "stream/publish_s": time.monotonic() - started - collect_s,
            "stream/weights_gb": size / 1e9,
        }

    def _exported(self, weights: Weights | TrainingEngine) -> tuple[Weights, dict[str, Any] | None]:
        """The per-tensor weights and the PEFT config (``None`` unless handed a LoRA training engine)."""
        if not isinstance(weights, TrainingEngine):
            return weights, None
        if self.settings.adapter is None:
            items, _ = weights.get_per_tensor_param()  # what verl's own non-naive path asks
            return cast("Weights", items), None
        # The adapter alone (verl's naive path asks the same for vLLM's TensorLoRARequest); never
        # the base (base_sync_done=False), which the gateways already hold.
        items, peft_config = weights.get_per_tensor_param(
            layered_summon=self.settings.layered_summon, base_sync_done=True
        )
        return cast("Weights", items), peft_config

    async def receive_weights(  # type: ignore[override]  # verl's stub says coroutine; its callers iterate
        self, global_steps: int | None = None
    ) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Nothing: the actor's rank 0 published to NATS, and gateways follow ``policy.updated`` there.

        verl's v1 separate-async trainer still runs its receive step on the rollout replica's
        worker (``CheckpointEngineWorker.update_weights``, ``verl/checkpoint_engine/base.py``): the
        stream-gateway replica's worker receives nothing and passes nothing on.
        """
        for _ in ():
            yield _


class StreamCheckpointManager:
    """verl's ``checkpoint_manager_class`` for gateways on NATS (see the module docstring).

    ``update_weights(k)`` publishes the actor's weights as policy version ``k`` (``k >= 1``, above
    every version already on the stream); every replica method does nothing.
    """

    def __init__(
        self,
        config: CheckpointEngineConfig,
        actor_wg: ActorWorkerGroup,
        replicas: list[RolloutReplica] | None = None,
    ) -> None:
        if config.backend != BACKEND:
            # With another backend the actor ranks hold another engine, which would take the
            # weights and send them nowhere we read: refuse at init_workers, not silently later.
            raise ValueError(
                f"StreamCheckpointManager needs actor_rollout_ref.rollout.checkpoint_engine.backend={BACKEND} "
                f"and custom_backend_module=consumers.verl_weights (got backend={config.backend!r})"
            )
        self.config = config
        self.settings = NatsWeightSettings.from_options(config.engine_kwargs.get(BACKEND))
        self.actor_wg = actor_wg
        self.replicas = list(replicas or [])
        self.synced_version = 0  # the newest step this manager has sent to the actor ranks
        # With an adapter, verl must hand the training engine over (ENGINE_MODE): in verl 0.9.1 the
        # iterable of mode=nats holds a LoRA actor's base weights only (see the module docstring).
        self.mode = ENGINE_MODE if self.settings.adapter is not None else BACKEND

    @_auto_await
    async def update_weights(self, global_steps: int | None = None) -> dict[str, float]:
        """Publish the actor's current weights (with ``adapter``: its LoRA adapter) as version
        ``global_steps``; the ranks' metrics."""
        if global_steps is None or global_steps < 1:
            log.info(
                "update_weights(%s): version 0 is the weights gateways start with; nothing published", global_steps
            )
            return {}
        if global_steps <= self.synced_version:
            log.info("update_weights(%d): version %d already published", global_steps, self.synced_version)
            return {}
        # One ObjectRef per actor rank (ONE_TO_ALL, blocking=False in verl 0.9.1).
        refs = self.actor_wg.update_weights(global_steps=global_steps, mode=self.mode)
        results = await asyncio.gather(*refs)
        self.synced_version = global_steps
        metrics: dict[str, float] = {}
        for result in results:
            if isinstance(result, dict):
                metrics.update(result)
        return metrics

    @_auto_await
    async def sleep_replicas(self) -> None:
        """Nothing: gateways keep serving live users through training."""

    @_auto_await
    async def wake_up_replicas(self) -> None:
        """Nothing: nothing was put to sleep."""

    @_auto_await
    async def abort_replicas(self, reject_request: bool = False) -> None:
        """Nothing: requests in flight continue, and cross the weight swap."""

    @_auto_await
    async def resume_generation_replicas(self) -> None:
        """Nothing: nothing was aborted."""

    @_auto_await
    async def release_kv_cache_replicas(self) -> None:
        """Nothing: gateways keep their KV caches."""

    @_auto_await
    async def resume_kv_cache_replicas(self) -> None:
        """Nothing: nothing was released."""

    def add_replicas(self, replicas: list[RolloutReplica]) -> None:
        """Remember verl's replicas (elastic scaling), as the default manager does; they are never touched."""
        self.replicas.extend(replicas)

    def remove_replicas(self, replicas: list[RolloutReplica]) -> None:
        """Forget verl's replicas."""
        gone = set(replicas)
        self.replicas = [r for r in self.replicas if r not in gone]


async def publish_weights(
    settings: NatsWeightSettings, tensors: Mapping[str, torch.Tensor], policy_version: int
) -> PolicyUpdated | None:
    """Publish ``tensors`` as ``policy_version`` unless the stream already has that version or a newer one.

    The published event, or ``None`` when skipped. Raises :class:`WeightPublishError`.
    """
    import nats.errors
    import nats.js.errors

    spec = settings.spec
    try:
        with anyio.fail_after(settings.publish_timeout_s):
            async with _connected(settings) as nc:
                js = nc.jetstream()
                await ensure_stream(js, spec)
                newest = await _newest_version(js, spec)
                if policy_version <= newest:
                    log.warning(
                        "policy version %d not published: the stream already has version %d (gateways refuse "
                        "versions not above the one they serve)",
                        policy_version,
                        newest,
                    )
                    return None
                event = await publish_tensors(
                    nc,
                    tensors,
                    policy_version,
                    spec=spec,
                    bucket=settings.bucket,
                    full=True,
                    model=settings.model,
                    weights=f"verl global_steps={policy_version}",
                    previous_version=newest or None,
                    keep_full=settings.keep_full,
                    progress=log.info,
                )
    except TimeoutError as exc:
        raise WeightPublishError(
            f"policy version {policy_version}: not published within {settings.publish_timeout_s:g} s"
        ) from exc
    except (nats.errors.Error, nats.js.errors.Error, OSError) as exc:
        raise WeightPublishError(f"policy version {policy_version}: {type(exc).__name__}: {exc}") from exc
    log.info(
        "published policy version %d (%d tensors) on %s", policy_version, len(tensors), ", ".join(settings.servers)
    )
    return event


async def publish_adapter(
    settings: NatsWeightSettings,
    tensors: Mapping[str, torch.Tensor],
    peft_config: Mapping[str, Any] | None,
    policy_version: int,
) -> PolicyUpdated | None:
    """Publish LoRA ``tensors`` with their PEFT ``peft_config`` as version ``policy_version`` of
    adapter ``settings.adapter``, unless the stream already has that adapter at this version or above.

    ``tensors``: ``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight``, as verl's engines
    yield them (:func:`_adapter_tensors` makes them so). Written as a PEFT adapter directory
    (``adapter_config.json``, ``adapter_model.safetensors``) and published with
    :func:`pipeline.policies.publish_policy` ``adapter=``. The published event, or ``None`` when
    skipped. Raises :class:`WeightPublishError`.
    """
    import nats.errors
    import nats.js.errors

    adapter = settings.adapter
    if adapter is None:
        raise ValueError("publish_adapter needs settings.adapter")
    config = _adapter_config(peft_config, tensors, adapter)
    spec = settings.spec
    try:
        with anyio.fail_after(settings.publish_timeout_s):
            async with _connected(settings) as nc:
                js = nc.jetstream()
                await ensure_stream(js, spec)
                newest = await newest_adapter_version(js, adapter, spec)
                if policy_version <= newest:
                    raise StalePolicyVersion(f"the stream already has version {newest}", newest)
                with tempfile.TemporaryDirectory(prefix="sg-adapter-") as directory:
                    await anyio.to_thread.run_sync(_write_adapter, Path(directory), config, tensors)
                    event = await publish_policy(
                        nc,
                        directory,
                        policy_version,
                        spec=spec,
                        bucket=settings.bucket,
                        model=settings.model,
                        weights=f"verl global_steps={policy_version} adapter={adapter}",
                        previous_version=newest or None,
                        keep_full=settings.keep_full,
                        progress=log.info,
                        adapter=adapter,
                    )
    except StalePolicyVersion as exc:  # ours above, or publish_policy's if another publisher raced us
        log.warning(
            "adapter %s version %d not published: %s (gateways refuse versions not above the one they serve)",
            adapter,
            policy_version,
            exc,
        )
        return None
    except TimeoutError as exc:
        raise WeightPublishError(
            f"adapter {adapter} version {policy_version}: not published within {settings.publish_timeout_s:g} s"
        ) from exc
    except (nats.errors.Error, nats.js.errors.Error, OSError) as exc:
        raise WeightPublishError(f"adapter {adapter} version {policy_version}: {type(exc).__name__}: {exc}") from exc
    log.info(
        "published adapter %s version %d (%d tensors, r=%s, lora_alpha=%s) on %s",
        adapter,
        policy_version,
        len(tensors),
        config.get("r"),
        config.get("lora_alpha"),
        ", ".join(settings.servers),
    )
    return event


def _adapter_tensors(tensors: Mapping[str, torch.Tensor], adapter: str) -> dict[str, torch.Tensor]:
    """The LoRA weights of ``tensors`` under PEFT's saved names; base weights are left out, with a log line.

    verl hands LoRA tensors as ``base_model.model.<module>.lora_A.weight``; a ``.default`` adapter
    segment or a missing ``base_model.model.`` prefix is normalized. Raises :class:`WeightPublishError`
    for a LoRA tensor that is not an A/B weight (DoRA's magnitude, embedding adapters) or none at all.
    """
    lora: dict[str, torch.Tensor] = {}
    ignored = 0
    for name, tensor in tensors.items():
        match = _LORA_KEY.fullmatch(name)
        if match is not None:
            lora[f"base_model.model.{match['module']}.lora_{match['which']}.weight"] = tensor
        elif "lora_" in name:
            raise WeightPublishError(f"adapter {adapter}: {name!r} is not a lora_A/lora_B weight (plain LoRA only)")
        else:
            ignored += 1
    if ignored:
        # The base weights (verl's base_sync_done=False export): the gateways already serve the
        # shared base from their --model; an adapter version holds only its A/B matrices.
        log.info("adapter %s: %d base-model tensors left out (the gateways serve the shared base)", adapter, ignored)
    if not lora:
        raise WeightPublishError(
            f"adapter {adapter}: the actor yielded no LoRA tensors ({ignored} others): train LoRA "
            "(actor_rollout_ref.model.lora_rank > 0) without merging (model.lora.merge false), with "
            f"StreamCheckpointManager (it asks verl for mode={ENGINE_MODE}: mode={BACKEND} yields the base only)"
        )
    return lora


def _adapter_config(
    peft_config: Mapping[str, Any] | None, tensors: Mapping[str, torch.Tensor], adapter: str
) -> dict[str, Any]:
    """``adapter_config.json`` from verl's PEFT config dict, as ``save_pretrained`` writes it, checked."""
    if peft_config is None:
        raise WeightPublishError(
            f"adapter {adapter}: the actor sent no LoRA config (verl's get_per_tensor_param returned None): "
            "train LoRA (actor_rollout_ref.model.lora_rank > 0) without merging (model.lora.merge false)"
        )
    config = {str(key): _jsonable(value) for key, value in peft_config.items()}
    config.setdefault("peft_type", "LORA")
    config.setdefault("bias", "none")
    config["inference_mode"] = True  # as PeftModel.save_pretrained writes it
    if config["peft_type"] != "LORA" or config["bias"] != "none":
        raise WeightPublishError(
            f"adapter {adapter}: peft_type {config['peft_type']!r}, bias {config['bias']!r}: "
            "the gateways apply plain LoRA (peft_type LORA, bias none)"
        )
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        module, which = name.removesuffix(".weight").rsplit(".lora_", 1)
        halves.setdefault(module, {})[which] = tensor
    for module, pair in sorted(halves.items()):
        if set(pair) != {"A", "B"} or pair["A"].dim() != 2 or pair["B"].dim() != 2:
            raise WeightPublishError(f"adapter {adapter}: {module}: needs a 2-D lora_A and lora_B")
        if pair["A"].shape[0] != pair["B"].shape[1]:
            raise WeightPublishError(
                f"adapter {adapter}: {module}: lora_A {list(pair['A'].shape)} and lora_B "
                f"{list(pair['B'].shape)} do not share a rank"
            )
    return config


def _jsonable(value: Any) -> Any:
    """A PEFT config value as JSON: enums as their value, sets as sorted lists (``save_pretrained`` lists them)."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, set | frozenset):
        return sorted(_jsonable(v) for v in value)
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return value


def _write_adapter(directory: Path, config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> None:
    """A PEFT adapter directory: ``adapter_config.json`` and ``adapter_model.safetensors``."""
    from safetensors.torch import save_file

    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True), encoding="utf-8")
    contiguous = {name: t.detach().contiguous().cpu() for name, t in tensors.items()}
    save_file(contiguous, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})


@asynccontextmanager
async def _connected(settings: NatsWeightSettings) -> AsyncIterator[Client]:
    async def quiet(exc: Exception) -> None:  # failures surface as the calls' exceptions
        log.debug("nats: %r", exc)

    try:
        nc = await connect(
            settings.servers,
            settings.auth,
            name="verl-weights",
            connect_timeout=settings.connect_timeout_s,
            max_reconnect_attempts=3,
            reconnect_time_wait=0.5,
            error_cb=quiet,
        )
    except NatsRefused as exc:
        raise WeightPublishError(str(exc)) from exc
    except Exception as exc:  # nats-py raises several unrelated types for "cannot connect"
        raise WeightPublishError(f"cannot connect to NATS at {', '.join(settings.servers)}: {exc!r}") from exc
    try:
        yield nc
    finally:
        await close_quietly(nc, _CLOSE_TIMEOUT_S)


async def _newest_version(js: JetStreamContext, spec: StreamSpec) -> int:
    """The version of the newest ``policy.updated`` on the stream; 0 if none."""
    from nats.js.errors import NotFoundError

    try:
        msg = await js.get_last_msg(spec.stream, policy_subject(spec.prefix))
    except NotFoundError:
        return 0
    event = decode_event(msg.data or b"")
    return event.policy_version if isinstance(event, PolicyUpdated) else 0


async def _items(
    weights: Iterable[tuple[str, torch.Tensor]] | AsyncIterable[tuple[str, torch.Tensor]],
) -> AsyncIterator[tuple[str, torch.Tensor]]:
    """Engines hand a generator, an ``items()`` view or an async generator: iterate any of them."""
    if isinstance(weights, AsyncIterable):
        async for item in weights:
            yield item
    else:
        for item in weights:
            yield item


async def _collect(
    weights: Iterable[tuple[str, torch.Tensor]] | AsyncIterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype | None,
) -> dict[str, torch.Tensor]:
    """Every tensor, copied to host memory (own storage: tied weights must not share it in safetensors)."""
    tensors: dict[str, torch.Tensor] = {}
    async for name, tensor in _items(weights):
        target = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        tensors[name] = tensor.detach().to(device="cpu", dtype=target, copy=True)
    return tensors
