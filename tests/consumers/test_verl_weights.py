"""verl's weight sync through NATS, against a real nats-server and verl 0.9.1's own code.

Real: the nats-server, verl's Hydra config and dataclasses, ``load_class_from_fqn``,
``import_external_libs`` and ``CheckpointEngineRegistry`` used as ``RayPPOTrainer.init_workers``
and ``ActorRolloutRefWorker.init_model`` use them, verl's own ``ActorRolloutRefWorker.update_weights``,
the tiny Qwen2 model's weights, :func:`pipeline.policies.download_policy` and the gateway's own
checkpoint checks.

Faked, because the real ones need GPUs: the FSDP/Megatron training engine
(:class:`_TrainingEngine`: ``get_per_tensor_param`` yields the tiny model's state dict, as the
real one yields gathered full tensors; :class:`_GlooEngine` adds one gloo collective per tensor).
Most tests also fake the actor ``RayWorkerGroup`` (:class:`_ActorGroup`: verl's worker method
called on a stand-in rank, one coroutine per rank where Ray returns one ``ObjectRef`` per rank);
``test_through_verls_ray_worker_group_on_cpu`` uses verl's real ``RayWorkerGroup`` instead, two
CPU Ray actors (:class:`_CpuActorWorker`) running verl's ``update_weights``.

LoRA (``adapter``): :class:`_LoraEngine` is verl's own ``FSDPEngine.get_per_tensor_param`` run on a
PEFT model of tiny that FSDP does not wrap (its ``fsdp_version == 0`` branch, on CPU; only verl's
CUDA-only memory logging and device lookup are patched out): the adapter tensors and PEFT config
dict exactly as verl exports them. The adapter is published against the real nats-server and
applied by a real in-process gateway, whose logprobs are compared with PEFT's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import warnings
from collections.abc import Awaitable, Callable, Iterator
from datetime import timedelta
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import httpx
import nats
import peft
import pytest
import torch
from omegaconf import DictConfig
from openai import OpenAI
from peft.utils.save_and_load import get_peft_model_state_dict
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from pipeline.embedded import EmbeddedNatsServer
from pipeline.events import PolicyUpdated
from pipeline.policies import download_policy, policy_history
from pipeline.streams import StreamSpec
from stream_gateway import Settings
from stream_gateway.engines import build_engine
from stream_gateway.engines._weights import check_tensors, read_checkpoint
from stream_gateway.lora import read_adapter

from ..support.ray_child import run_in_ray
from ..support.servers import RunningGateway, run_gateway
from ..support.waiting import wait_until

with warnings.catch_warnings():  # verl imports ray's deprecated ray.experimental state API
    warnings.simplefilter("ignore", DeprecationWarning)
    from verl.checkpoint_engine.base import CheckpointEngineRegistry
    from verl.single_controller.base import Worker
    from verl.single_controller.base.decorator import Dispatch, register
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.import_utils import import_external_libs, load_class_from_fqn
    from verl.workers.config import CheckpointEngineConfig

    # verl.workers.engine imports every engine and warns for each optional one not installed
    # (torchtitan, veomni, automodel, ...): only its FSDP engine is used here.
    warnings.filterwarnings("ignore", r"\w+ engine is not available", UserWarning)
    from verl.workers.engine.fsdp import transformer_impl as fsdp_engine
    from verl.workers.engine_workers import ActorRolloutRefWorker

    from consumers.errors import WeightPublishError
    from consumers.verl_weights import NatsCheckpointEngine, NatsWeightSettings, StreamCheckpointManager

ROOT = Path(__file__).resolve().parents[2]  # the Ray workers import tests.*

BASE_YAML = """\
hydra:
  searchpath:
    - pkg://verl.trainer.config

defaults:
  - ppo_trainer
  - _self_

actor_rollout_ref:
  rollout:
    name: vllm
"""

DOCS_YAML = (
    BASE_YAML
    + """\
    checkpoint_manager_class: consumers.verl_weights.StreamCheckpointManager
    checkpoint_engine:
      backend: nats
      custom_backend_module: consumers.verl_weights
      engine_kwargs:
        nats:
          servers: [{servers}]
          prefix: {prefix}
          stream: {stream}
          bucket: {bucket}
          dtype: {dtype}
"""
)


def _names() -> dict[str, str]:
    """A subject prefix, events stream and bucket no other test uses (gateways of other tests follow ``sg``)."""
    tag = secrets.token_hex(4)
    return {"prefix": f"t{tag}", "stream": f"W_{tag}", "bucket": f"pol_{tag}"}


def _verl_config(
    tmp_path: Path, servers: str, *, dtype: str | None = None, form: str = "yaml", adapter: str | None = None
) -> DictConfig:
    """verl's full trainer config, composed by Hydra over ``ppo_trainer`` with our keys (YAML or CLI overrides)."""
    from hydra import compose, initialize_config_dir

    names = _names()
    overrides: list[str] = []
    if form == "yaml":
        text = DOCS_YAML.format(servers=servers, dtype=dtype or "null", **names)
        (tmp_path / "trainer.yaml").write_text(text + (f"          adapter: {adapter}\n" if adapter else ""))
    else:  # the Hydra command line of docs/verl-weights.md
        (tmp_path / "trainer.yaml").write_text(BASE_YAML)
        nats_key = "+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.nats"
        overrides = [
            "+actor_rollout_ref.rollout.checkpoint_manager_class=consumers.verl_weights.StreamCheckpointManager",
            "actor_rollout_ref.rollout.checkpoint_engine.backend=nats",
            "actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=consumers.verl_weights",
            f"{nats_key}.servers=[{servers}]",
            *(f"{nats_key}.{key}={value}" for key, value in names.items()),
        ]
        if dtype is not None:
            overrides.append(f"{nats_key}.dtype={dtype}")
        if adapter is not None:
            overrides.append(f"{nats_key}.adapter={adapter}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with initialize_config_dir(config_dir=str(tmp_path), version_base=None):
            return compose(config_name="trainer", overrides=overrides)


class _TrainingEngine:
    """Stands in for verl's FSDP/Megatron engine: ``get_per_tensor_param`` yields ``state``."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state = state
        self.exported = 0
        self.exhausted = 0  # the real generator runs collectives: every rank must reach its end

    def get_per_tensor_param(self, **kwargs: Any) -> tuple[Iterator[tuple[str, torch.Tensor]], None]:
        self.exported += 1

        def generate() -> Iterator[tuple[str, torch.Tensor]]:
            yield from self.state.items()
            self.exhausted += 1

        return generate(), None


class _Actor:
    """``ActorRolloutRefWorker.actor`` (a ``TrainingWorker``): only its ``engine`` is read."""

    def __init__(self, engine: _TrainingEngine) -> None:
        self.engine = engine


class _ActorRank:
    """The attributes ``ActorRolloutRefWorker.update_weights`` reads of ``self`` on one rank."""

    def __init__(self, config: DictConfig, engine: _TrainingEngine, checkpoint_engine: Any) -> None:
        self.config = config  # actor_rollout_ref, as the worker holds it
        self.actor = _Actor(engine)
        self.checkpoint_engine = checkpoint_engine


class _ActorGroup:
    """Stands in for the actor ``RayWorkerGroup``: verl's real worker method on each rank, one awaitable each."""

    def __init__(self, ranks: list[_ActorRank]) -> None:
        self.ranks = ranks
        self.world_size = len(ranks)

    def update_weights(self, *, global_steps: int, mode: str) -> list[Awaitable[Any]]:
        update = ActorRolloutRefWorker.update_weights
        return [update(rank, global_steps=global_steps, mode=mode) for rank in self.ranks]

    @property
    def engines(self) -> list[Any]:
        return [rank.actor.engine for rank in self.ranks]


class _GlooEngine(_TrainingEngine):
    """``_TrainingEngine`` with one collective per tensor, as FSDP's ``full_tensor()`` all-gathers."""

    def get_per_tensor_param(self, **kwargs: Any) -> tuple[Iterator[tuple[str, torch.Tensor]], None]:
        self.exported += 1

        def generate() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in self.state.items():
                gathered = tensor.clone()
                torch.distributed.broadcast(gathered, src=0)  # a rank that stops iterating hangs the others
                yield name, gathered
            self.exhausted += 1

        return generate(), None


class _CpuActorWorker(Worker):
    """verl's ``ActorRolloutRefWorker`` cut to what weight sync uses, on CPU: gloo instead of FSDP."""

    update_weights = ActorRolloutRefWorker.update_weights  # verl's own: @register(ONE_TO_ALL, blocking=False)

    def __init__(self, config: DictConfig, model_path: str) -> None:
        super().__init__()
        self.config = config  # actor_rollout_ref
        self.model_path = model_path

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)  # type: ignore[attr-defined, no-untyped-call, untyped-decorator]
    def init_model(self) -> None:
        # RANK, WORLD_SIZE, MASTER_*: set by the worker group. A rank left waiting fails, not hangs.
        torch.distributed.init_process_group("gloo", timeout=timedelta(seconds=60))
        _, state = _model_state(Path(self.model_path))
        self.actor = _Actor(_GlooEngine(state))
        # Step 4 of ActorRolloutRefWorker.init_model (verl 0.9.1), verbatim.
        checkpoint_engine_config = omega_conf_to_dataclass(self.config.rollout.checkpoint_engine)
        backend = checkpoint_engine_config.backend
        bucket_size = checkpoint_engine_config.update_weights_bucket_megabytes << 20
        engine_kwargs = checkpoint_engine_config.engine_kwargs.get(backend, {})
        import_external_libs(checkpoint_engine_config.custom_backend_module or None)  # type: ignore[no-untyped-call]
        self.checkpoint_engine = CheckpointEngineRegistry.new(
            backend, is_master=(torch.distributed.get_rank() == 0), bucket_size=bucket_size, **engine_kwargs
        )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)  # type: ignore[attr-defined, no-untyped-call, untyped-decorator]
    def export_counts(self) -> tuple[int, int]:
        return self.actor.engine.exported, self.actor.engine.exhausted


class _Replica:
    """A verl rollout replica that records every method called on it."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        self.calls.append(name)
        raise AssertionError(f"the manager touched a replica: {name}")


def _actor_group(
    config: DictConfig,
    state: dict[str, torch.Tensor],
    world_size: int = 2,
    engine: Callable[[], Any] | None = None,
) -> _ActorGroup:
    """The checkpoint engines as ``ActorRolloutRefWorker.init_model`` (verl 0.9.1, step 4) builds them;
    each rank's training engine ``engine()``, by default a :class:`_TrainingEngine` of ``state``."""
    checkpoint_engine_config = omega_conf_to_dataclass(config.actor_rollout_ref.rollout.checkpoint_engine)
    backend = checkpoint_engine_config.backend
    import_external_libs(checkpoint_engine_config.custom_backend_module or None)  # type: ignore[no-untyped-call]
    ranks = []
    for rank in range(world_size):
        checkpoint_engine = CheckpointEngineRegistry.new(
            backend,
            is_master=rank == 0,
            bucket_size=checkpoint_engine_config.update_weights_bucket_megabytes << 20,
            **checkpoint_engine_config.engine_kwargs.get(backend, {}),
        )
        training = engine() if engine is not None else _TrainingEngine(state)
        ranks.append(_ActorRank(config.actor_rollout_ref, training, checkpoint_engine))
    return _ActorGroup(ranks)


def _init_workers(config: DictConfig, actor_wg: Any, replicas: list[Any]) -> Any:
    """The lines of ``RayPPOTrainer.init_workers`` (verl 0.9.1) that build the checkpoint manager."""
    checkpoint_engine_config = omega_conf_to_dataclass(config.actor_rollout_ref.rollout.checkpoint_engine)
    checkpoint_manager_class_fqn = config.actor_rollout_ref.rollout.get("checkpoint_manager_class")
    manager_class = load_class_from_fqn(checkpoint_manager_class_fqn, "CheckpointEngineManager")
    manager = manager_class(config=checkpoint_engine_config, actor_wg=actor_wg, replicas=replicas)
    manager.sleep_replicas()
    return manager


def _model_state(path: Path) -> tuple[Any, dict[str, torch.Tensor]]:
    """The tiny model and its state dict as an FSDP engine exports it: every name, tied ones too."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model, dict(model.state_dict())


def _spec(manager: StreamCheckpointManager) -> StreamSpec:
    return manager.settings.spec


async def _events(url: str, spec: StreamSpec) -> list[PolicyUpdated]:
    nc = await nats.connect(url)
    try:
        return await policy_history(nc.jetstream(), spec)
    finally:
        await nc.close()


async def _download(url: str, event: PolicyUpdated, directory: Path) -> dict[str, torch.Tensor]:
    nc = await nats.connect(url)
    try:
        paths = await download_policy(nc.jetstream(), event, directory)
    finally:
        await nc.close()
    tensors: dict[str, torch.Tensor] = {}
    for path in paths:
        tensors.update(load_file(str(path)))
    return tensors


def _sync_events(url: str, spec: StreamSpec) -> list[PolicyUpdated]:
    return anyio.run(_events, url, spec)


@pytest.mark.parametrize("form", ["yaml", "overrides"])
def test_verl_config_selects_the_manager_and_the_engine(tmp_path: Path, form: str) -> None:
    config = _verl_config(tmp_path, "nats://10.0.0.5:4222,nats://10.0.0.6:4222", dtype="bfloat16", form=form)
    rollout = config.actor_rollout_ref.rollout
    assert omega_conf_to_dataclass(rollout).checkpoint_manager_class == (  # verl's RolloutConfig schema has it
        "consumers.verl_weights.StreamCheckpointManager"
    )
    group = _actor_group(config, {})
    manager = _init_workers(config, group, replicas=[])
    assert isinstance(manager, StreamCheckpointManager)
    engines = [rank.checkpoint_engine for rank in group.ranks]
    assert all(isinstance(e, NatsCheckpointEngine) for e in engines)
    assert [e.is_master for e in engines] == [True, False]
    for settings in (manager.settings, engines[0].settings):
        assert settings.servers == ("nats://10.0.0.5:4222", "nats://10.0.0.6:4222")
        assert settings.torch_dtype() is torch.bfloat16
        assert settings.prefix.startswith("t") and settings.stream.startswith("W_")

    # verl's rollout-side CheckpointEngineWorker builds the backend too (no is_master): it receives
    # nothing (the gateways receive from NATS), which verl's v1 separate-async sync iterates.
    receiver = CheckpointEngineRegistry.new("nats", bucket_size=1 << 20)

    async def received() -> list[Any]:
        return [item async for item in receiver.receive_weights(global_steps=1)]

    assert anyio.run(received) == []


def test_wrong_backend_or_settings_fail_when_the_trainer_starts() -> None:
    naive = CheckpointEngineConfig(backend="naive")
    with pytest.raises(ValueError, match=r"checkpoint_engine.backend=nats and custom_backend_module"):
        StreamCheckpointManager(config=naive, actor_wg=_ActorGroup([]), replicas=[])
    typo = CheckpointEngineConfig(backend="nats", engine_kwargs={"nats": {"server": "nats://x:4222"}})
    with pytest.raises(ValueError, match=r"unknown nats checkpoint engine settings \['server'\]"):
        StreamCheckpointManager(config=typo, actor_wg=_ActorGroup([]), replicas=[])
    with pytest.raises(ValueError, match="not a torch floating dtype"):
        NatsWeightSettings.from_options({"dtype": "int8"})
    with pytest.raises(ValueError, match=r"adapter 'team a': 1-128 of"):
        NatsWeightSettings.from_options({"adapter": "team a"})
    with pytest.raises(ValueError, match="replicas 6: from 1 to 5"):
        NatsWeightSettings.from_options({"replicas": 6})
    assert NatsWeightSettings.from_options(None).servers == ("nats://127.0.0.1:4222",)
    # The events stream is the gateways': unset, its replicas are left as they are (pipeline.streams).
    assert NatsWeightSettings.from_options(None).spec.replicas is None
    assert NatsWeightSettings.from_options({"replicas": 3}).spec.replicas == 3
    assert NatsWeightSettings.from_options({"servers": "nats://a:1, nats://b:2"}).servers == (
        "nats://a:1",
        "nats://b:2",
    )


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_update_weights_publishes_the_actors_weights_as_the_step(
    nats_server: EmbeddedNatsServer, tiny_model_path: Path, tmp_path: Path, dtype: str | None
) -> None:
    """As ``fit`` calls it after ``update_actor``: synchronously; a gateway would apply the result."""
    model, state = _model_state(tiny_model_path)
    config = _verl_config(tmp_path, nats_server.url, dtype=dtype)
    group = _actor_group(config, state)
    replica = _Replica()
    manager = _init_workers(config, group, replicas=[replica])

    metrics = manager.update_weights(1)

    assert metrics["stream/policy_version"] == 1.0 and metrics["stream/weights_gb"] > 0
    assert [(e.exported, e.exhausted) for e in group.engines] == [(1, 1), (1, 1)]
    (event,) = _sync_events(nats_server.url, _spec(manager))
    assert (event.policy_version, event.full, event.previous_version) == (1, True, None)
    assert (event.weights, event.bucket) == ("verl global_steps=1", manager.settings.bucket)

    downloaded = tmp_path / "downloaded"
    downloaded.mkdir()
    tensors = anyio.run(_download, nats_server.url, event, downloaded)
    want = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    assert list(tensors) == sorted(state)  # every tensor, tied lm_head.weight included
    for name, tensor in tensors.items():
        assert tensor.dtype == want, name
        assert torch.equal(tensor, state[name].to(want)), name

    # What the gateway's engine checks before it applies a policy: names and shapes of its model.
    targets = dict(model.state_dict(keep_vars=True))
    checkpoint = read_checkpoint(downloaded)
    check_tensors(targets, checkpoint)
    assert {name: tuple(t.shape) for name, t in checkpoint.items()} == {
        name: tuple(t.shape) for name, t in targets.items()
    }
    assert replica.calls == []


def test_versions_only_go_up(nats_server: EmbeddedNatsServer, tiny_model_path: Path, tmp_path: Path) -> None:
    """Step 0 publishes nothing; a step already on the stream (a resumed run) is not sent again."""
    _, state = _model_state(tiny_model_path)
    config = _verl_config(tmp_path, nats_server.url)
    group = _actor_group(config, state)
    manager = _init_workers(config, group, replicas=[])
    spec = _spec(manager)

    assert manager.update_weights(0) == {}  # fit's first call on a fresh start: the gateways' version 0
    assert [e.exported for e in group.engines] == [0, 0]
    assert manager.update_weights(1)["stream/policy_version"] == 1.0
    assert manager.update_weights(1) == {}  # e.g. _validate's "wake up" call with the same step
    assert [e.exported for e in group.engines] == [1, 1]

    # A resumed trainer (new process, new manager) re-sends its checkpoint's step: drained, not published.
    resumed_group = _actor_group(config, state)
    resumed = _init_workers(config, resumed_group, replicas=[])
    assert resumed.update_weights(1) == {"stream/policy_version_skipped": 1.0}
    assert [(e.exported, e.exhausted) for e in resumed_group.engines] == [(1, 1), (1, 1)]
    assert [e.policy_version for e in _sync_events(nats_server.url, spec)] == [1]

    trained = {name: t + 0.5 for name, t in state.items()}
    for engine in resumed_group.engines:
        engine.state = trained
    assert resumed.update_weights(2)["stream/policy_version"] == 2.0
    events = _sync_events(nats_server.url, spec)
    assert [(e.policy_version, e.previous_version) for e in events] == [(1, None), (2, 1)]
    tensors = anyio.run(_download, nats_server.url, events[-1], tmp_path)
    assert all(torch.equal(tensors[name], trained[name]) for name in trained)


@pytest.mark.anyio
async def test_awaited_or_called_from_a_running_loop(
    nats_server: EmbeddedNatsServer, tiny_model_path: Path, tmp_path: Path
) -> None:
    """verl's ``auto_await``: a coroutine may await; a sync caller on a running loop gets a worker thread."""
    _, state = _model_state(tiny_model_path)
    config = await anyio.to_thread.run_sync(_verl_config, tmp_path, nats_server.url)
    manager = _init_workers(config, _actor_group(config, state), replicas=[])

    metrics = await manager.update_weights(global_steps=1)
    assert metrics["stream/policy_version"] == 1.0

    def sync_step() -> dict[str, float]:
        result: dict[str, float] = manager.update_weights(2)  # blocks this loop, as verl's own managers do
        return result

    assert sync_step()["stream/policy_version"] == 2.0
    assert await manager.sleep_replicas() is None
    events = await _events(nats_server.url, _spec(manager))
    assert [e.policy_version for e in events] == [1, 2]


def test_replica_methods_do_nothing() -> None:
    """Gateways never sleep: no call reaches verl's replicas or the actors."""
    config = CheckpointEngineConfig(backend="nats")
    replica: Any = _Replica()
    manager = StreamCheckpointManager(config=config, actor_wg=_ActorGroup([]), replicas=[replica])
    assert manager.sleep_replicas() is None
    assert manager.wake_up_replicas() is None
    assert manager.abort_replicas(reject_request=True) is None
    assert manager.resume_generation_replicas() is None
    assert manager.release_kv_cache_replicas() is None
    assert manager.resume_kv_cache_replicas() is None
    extra: Any = _Replica()
    manager.add_replicas([extra])
    manager.remove_replicas([replica])
    assert manager.replicas == [extra]
    assert replica.calls == [] and extra.calls == []


def test_nats_down_every_rank_drains_then_a_clear_error(tiny_model_path: Path, tmp_path: Path) -> None:
    """Rank 0 touches NATS only after the export: the other ranks never wait in a collective for it."""
    _, state = _model_state(tiny_model_path)
    config = _verl_config(tmp_path, "nats://127.0.0.1:1")
    group = _actor_group(config, state)
    for rank in group.ranks:
        rank.checkpoint_engine.settings = NatsWeightSettings(servers=("nats://127.0.0.1:1",), connect_timeout_s=0.5)
    manager = _init_workers(config, group, replicas=[])
    with pytest.raises(WeightPublishError, match=r"cannot connect to NATS at nats://127\.0\.0\.1:1"):
        manager.update_weights(1)
    assert [(e.exported, e.exhausted) for e in group.engines] == [(1, 1), (1, 1)]
    assert manager.synced_version == 0  # the next call tries again


@pytest.mark.timeout(720)  # the Ray child's start may be made twice (2 x 180 s), then 300 s
def test_through_verls_ray_worker_group_on_cpu(
    nats_server: EmbeddedNatsServer, tiny_model_path: Path, tmp_path: Path
) -> None:
    """The real path minus FSDP: verl's ``RayWorkerGroup`` of two CPU Ray actors (gloo), verl's own
    ``update_weights`` bound with its ONE_TO_ALL non-blocking dispatch, our engine publishing from
    inside rank 0's Ray event loop, and the manager awaiting the ``ObjectRef`` s verl returns. The
    Ray driver is a child process (:func:`_update_through_ray`)."""
    config = _verl_config(tmp_path, nats_server.url)
    _, state = _model_state(tiny_model_path)
    metrics, counts, spec = run_in_ray(
        _update_through_ray, config, str(tiny_model_path),
        num_cpus=2, namespace=f"vw-{secrets.token_hex(4)}", pythonpath=ROOT, timeout=300,
    )  # fmt: skip

    assert metrics["stream/policy_version"] == 1.0
    assert counts == [(1, 1), (1, 1)]
    (event,) = _sync_events(nats_server.url, spec)
    tensors = anyio.run(_download, nats_server.url, event, tmp_path)
    assert list(tensors) == sorted(state)
    assert all(torch.equal(tensors[name], state[name]) for name in state)


def _update_through_ray(config: DictConfig, model_path: str) -> tuple[dict[str, Any], list[Any], StreamSpec]:
    """In the Ray child: verl's worker group of two :class:`_CpuActorWorker`, the manager as
    ``init_workers`` builds it, one ``update_weights``; its metrics, each rank's export counts, its stream."""
    import ray

    pool = RayResourcePool(process_on_nodes=[2], use_gpu=False, max_colocate_count=1)
    worker = RayClassWithInitArgs(
        cls=ray.remote(_CpuActorWorker), config=config.actor_rollout_ref, model_path=model_path
    )
    actor_wg: Any = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=worker, device_name="cpu")
    actor_wg.init_model()
    manager = _init_workers(config, actor_wg, replicas=[])
    metrics = manager.update_weights(1)
    return dict(metrics), list(actor_wg.export_counts()), _spec(manager)


# -- LoRA: one adapter per trainer ---------------------------------------------------------------

ADAPTER = "alpha"
LORA = {"r": 4, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}


class _LoraEngine:
    """verl 0.9.1's ``FSDPEngine`` on a PEFT model that FSDP does not wrap: its own
    ``get_per_tensor_param``, with the attributes that method reads (``lora.merge`` false, no
    offload, no QAT; the FSDP2 CPU-offload flag skips ``load_fsdp_model_to_gpu``, which needs CUDA)."""

    def __init__(self, model: Any) -> None:
        self.module = model
        self.model_config = SimpleNamespace(lora={}, hf_config=model.config)
        self._uses_fsdp2_cpu_offload_policy = True
        self._is_offload_param = False
        self._qat_enabled = False
        self.calls: list[dict[str, Any]] = []

    def get_per_tensor_param(self, **kwargs: Any) -> tuple[Any, dict[str, Any] | None]:
        self.calls.append(kwargs)
        verls: Any = fsdp_engine.FSDPEngine.get_per_tensor_param  # unbound, on this stand-in
        result: tuple[Any, dict[str, Any] | None] = verls(self, **kwargs)
        return result


@pytest.fixture
def cpu_verl(monkeypatch: pytest.MonkeyPatch) -> None:
    """verl's FSDP engine module on a CPU-only torch: its GPU memory log and device id need CUDA."""
    monkeypatch.setattr(fsdp_engine, "log_gpu_memory_usage", lambda *args, **kwargs: None)
    monkeypatch.setattr(fsdp_engine, "get_device_id", lambda: "cpu")


def _lora_model(tiny_model_path: Path) -> Any:
    """The PEFT model verl's ``FSDPEngine._build_lora_module`` builds (``lora_rank: 4``, ``lora_alpha: 16``,
    ``target_modules: [q_proj, v_proj]``), on tiny in float32."""
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    config = peft.LoraConfig(task_type=peft.TaskType.CAUSAL_LM, bias="none", **LORA)  # type: ignore[arg-type]
    return peft.get_peft_model(base, config).eval()


def _train(model: Any, seed: int) -> dict[str, torch.Tensor]:
    """A training step: new random A and B (PEFT starts B at zero, which changes nothing); the adapter."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return {name: t.clone() for name, t in get_peft_model_state_dict(model).items()}


async def _adapter_events(url: str, spec: StreamSpec) -> list[PolicyUpdated]:
    nc = await nats.connect(url)
    try:
        return await policy_history(nc.jetstream(), spec, adapters=True)
    finally:
        await nc.close()


async def _download_adapter(url: str, event: PolicyUpdated, directory: Path) -> Path:
    """The published adapter's files (``download_policy``: digests checked); the directory holding them."""
    await anyio.Path(directory).mkdir()
    nc = await nats.connect(url)
    try:
        paths = await download_policy(nc.jetstream(), event, directory)
    finally:
        await nc.close()
    assert sorted(path.name for path in paths) == ["adapter_config.json", "adapter_model.safetensors"]
    (parent,) = {path.parent for path in paths}
    return parent


def _served_logprobs_match(gateway: RunningGateway, model: Any, version: int) -> None:
    """A request naming the adapter is served by ``version``, with PEFT's logprobs for ``model`` (atol 2e-4)."""
    session = f"vw{secrets.token_hex(4)}"
    with OpenAI(base_url=f"{gateway.base_url}/sessions/{session}/v1", api_key="k", max_retries=0) as client:
        client.chat.completions.create(
            model=ADAPTER, messages=[{"role": "user", "content": "Tell me about the sea."}], max_tokens=16
        )
    response = httpx.get(f"{gateway.base_url}/sessions/{session}", headers={"authorization": "Bearer k"})
    response.raise_for_status()
    (turn,) = response.json()["turns"]
    assert turn["adapter"] == ADAPTER and turn["policy_versions"] == [[version, 0]]  # [version, first token]
    prompt, output = turn["prompt_ids"], turn["output_ids"]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]
    expected = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(output)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(turn["logprobs"]), expected, atol=2e-4, rtol=0)


def _serves(gateway: RunningGateway, version: int) -> bool:
    return gateway.engine.adapters.get(ADAPTER) == version


@pytest.mark.usefixtures("cpu_verl")
def test_a_lora_actor_publishes_its_adapter_and_a_gateway_serves_it(
    nats_server: EmbeddedNatsServer, tiny_model_path: Path, tmp_path: Path
) -> None:
    """``adapter: alpha``: each step's LoRA tensors, as verl's FSDP engine exports them, become
    version ``step`` of adapter alpha; a gateway serving alpha applies it and scores as PEFT does."""
    model = _lora_model(tiny_model_path)
    _train(model, 0)
    model.save_pretrained(tmp_path / "alpha-0")  # what the gateways serve as version 0 (--lora alpha=DIR)
    config = _verl_config(tmp_path, nats_server.url, form="overrides", adapter=ADAPTER)
    group = _actor_group(config, {}, engine=lambda: _LoraEngine(model))
    manager = _init_workers(config, group, replicas=[])
    assert (manager.settings.adapter, manager.mode) == (ADAPTER, "delta_sharded")
    spec = _spec(manager)
    settings = Settings(
        model=str(tiny_model_path),
        served_model_name="tiny",
        lora=(f"{ADAPTER}={tmp_path / 'alpha-0'}",),
        nats_url=nats_server.url,
        subject_prefix=spec.prefix,
        events_stream=spec.stream,
        outbox_dir=tmp_path / "outbox",
        replica_id="g1",
    )
    with run_gateway(build_engine(settings), settings) as gateway:
        assert dict(gateway.engine.adapters) == {ADAPTER: 0}
        assert manager.update_weights(0) == {}  # a fresh start: version 0 is the gateways' --lora directory

        for step in (1, 2):
            trained = _train(model, step)
            metrics = manager.update_weights(step)
            assert metrics["stream/policy_version"] == float(step) and metrics["stream/weights_gb"] > 0
            # Every rank asked verl's engine for the adapter alone, never the base.
            assert [e.calls for e in group.engines] == [[{"layered_summon": False, "base_sync_done": True}] * step] * 2

            event = anyio.run(_adapter_events, nats_server.url, spec)[-1]
            assert (event.adapter, event.policy_version, event.previous_version) == (ADAPTER, step, step - 1 or None)
            assert event.weights == f"verl global_steps={step} adapter={ADAPTER}"
            directory = anyio.run(_download_adapter, nats_server.url, event, tmp_path / f"downloaded-{step}")
            written = json.loads((directory / "adapter_config.json").read_text())
            assert {k: written[k] for k in ("peft_type", "r", "lora_alpha", "target_modules", "bias")} == {
                "peft_type": "LORA",
                "r": 4,
                "lora_alpha": 16,
                "target_modules": ["q_proj", "v_proj"],
                "bias": "none",
            }
            assert load_file(directory / "adapter_model.safetensors").keys() == trained.keys()
            adapter = read_adapter(directory)  # the gateway's own reader: the same tensors and scaling
            assert len(adapter.modules) == len(trained) // 2
            for module, (a, b, scaling) in adapter.modules.items():
                assert torch.equal(a, trained[f"base_model.model.{module}.lora_A.weight"])
                assert torch.equal(b, trained[f"base_model.model.{module}.lora_B.weight"])
                assert scaling == 4.0

            wait_until(partial(_serves, gateway, step), f"alpha v{step} applied")
            _served_logprobs_match(gateway, model, step)

        # The base's own versions are untouched: nothing on its subject.
        assert _sync_events(nats_server.url, spec) == []
        assert gateway.engine.policy_version == 0

    # A resumed trainer re-sending its checkpoint's step: every rank drains, nothing is published.
    resumed_group = _actor_group(config, {}, engine=lambda: _LoraEngine(model))
    resumed = _init_workers(config, resumed_group, replicas=[])
    assert resumed.update_weights(2) == {"stream/policy_version_skipped": 2.0}
    assert [len(e.calls) for e in resumed_group.engines] == [1, 1]
    assert [e.policy_version for e in anyio.run(_adapter_events, nats_server.url, spec)] == [1, 2]


@pytest.mark.usefixtures("cpu_verl")
def test_a_lora_actors_base_weights_are_never_published_as_the_adapter(
    nats_server: EmbeddedNatsServer, tiny_model_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """verl 0.9.1's ``mode=nats`` path hands a LoRA actor's base weights only (``get_per_tensor_param()``,
    ``base_sync_done=False``): with an adapter set, every rank drains them and rank 0 refuses with a
    clear error. Base tensors beside the adapter's are left out of it, with a log line."""
    model = _lora_model(tiny_model_path)
    trained = _train(model, 3)
    config = _verl_config(tmp_path, nats_server.url, adapter=ADAPTER)
    group = _actor_group(config, {}, engine=lambda: _LoraEngine(model))
    spec = group.ranks[0].checkpoint_engine.settings.spec

    base, peft_config = _LoraEngine(model).get_per_tensor_param()  # what verl's mode=nats sends
    base = dict(base)
    assert peft_config is not None and not any("lora_" in name for name in base)
    assert "model.layers.0.self_attn.q_proj.base_layer.weight" in base  # verl's replace_lora_wrapper names

    async def through_nats_mode() -> list[Any]:
        refs = group.update_weights(global_steps=1, mode="nats")
        return await asyncio.gather(*refs, return_exceptions=True)

    with caplog.at_level(logging.INFO, logger="consumers.verl_weights"):
        first, second = anyio.run(through_nats_mode)
    assert isinstance(first, WeightPublishError) and second == {}
    assert "no LoRA tensors" in str(first) and "mode=delta_sharded" in str(first)
    assert f"{len(base)} base-model tensors left out" in caplog.text
    assert [e.calls for e in group.engines] == [[{}], [{}]]

    # An engine that yields base weights beside the adapter: only lora_A/lora_B are published.
    class _BaseAndAdapter(_LoraEngine):
        def get_per_tensor_param(self, **kwargs: Any) -> tuple[Any, dict[str, Any] | None]:
            adapter, config = super().get_per_tensor_param(**kwargs)
            return [*base.items(), *adapter], config

    for rank in group.ranks:
        rank.actor.engine = _BaseAndAdapter(model)  # type: ignore[assignment]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="consumers.verl_weights"):
        metrics = anyio.run(lambda: asyncio.gather(*group.update_weights(global_steps=1, mode="delta_sharded")))
    assert metrics[0]["stream/policy_version"] == 1.0
    assert f"{len(base)} base-model tensors left out" in caplog.text
    (event,) = anyio.run(_adapter_events, nats_server.url, spec)
    directory = anyio.run(_download_adapter, nats_server.url, event, tmp_path / "downloaded")
    tensors = load_file(directory / "adapter_model.safetensors")
    assert tensors.keys() == trained.keys()
    assert all(torch.equal(tensors[name], trained[name]) for name in trained)
