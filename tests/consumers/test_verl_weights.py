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
"""

from __future__ import annotations

import secrets
import warnings
from collections.abc import Awaitable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio
import nats
import pytest
import torch
from omegaconf import DictConfig
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from pipeline.embedded import EmbeddedNatsServer
from pipeline.events import PolicyUpdated
from pipeline.policies import download_policy, policy_history
from pipeline.streams import StreamSpec
from stream_gateway.engines._weights import check_tensors, read_checkpoint

with warnings.catch_warnings():  # verl imports ray's deprecated ray.experimental state API
    warnings.simplefilter("ignore", DeprecationWarning)
    from verl.checkpoint_engine.base import CheckpointEngineRegistry
    from verl.single_controller.base import Worker
    from verl.single_controller.base.decorator import Dispatch, register
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.import_utils import import_external_libs, load_class_from_fqn
    from verl.workers.config import CheckpointEngineConfig
    from verl.workers.engine_workers import ActorRolloutRefWorker

    from consumers.verl_weights import (
        NatsCheckpointEngine,
        NatsWeightSettings,
        StreamCheckpointManager,
        WeightPublishError,
    )

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


def _verl_config(tmp_path: Path, servers: str, *, dtype: str | None = None, form: str = "yaml") -> DictConfig:
    """verl's full trainer config, composed by Hydra over ``ppo_trainer`` with our keys (YAML or CLI overrides)."""
    from hydra import compose, initialize_config_dir

    names = _names()
    overrides: list[str] = []
    if form == "yaml":
        (tmp_path / "trainer.yaml").write_text(DOCS_YAML.format(servers=servers, dtype=dtype or "null", **names))
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
    def engines(self) -> list[_TrainingEngine]:
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


def _actor_group(config: DictConfig, state: dict[str, torch.Tensor], world_size: int = 2) -> _ActorGroup:
    """The checkpoint engines as ``ActorRolloutRefWorker.init_model`` (verl 0.9.1, step 4) builds them."""
    checkpoint_engine_config = omega_conf_to_dataclass(config.actor_rollout_ref.rollout.checkpoint_engine)
    backend = checkpoint_engine_config.backend
    import_external_libs(checkpoint_engine_config.custom_backend_module or None)  # type: ignore[no-untyped-call]
    ranks = []
    for rank in range(world_size):
        engine = CheckpointEngineRegistry.new(
            backend,
            is_master=rank == 0,
            bucket_size=checkpoint_engine_config.update_weights_bucket_megabytes << 20,
            **checkpoint_engine_config.engine_kwargs.get(backend, {}),
        )
        ranks.append(_ActorRank(config.actor_rollout_ref, _TrainingEngine(state), engine))
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

    # verl's rollout-side CheckpointEngineWorker builds the backend too (no is_master): it only refuses to receive.
    receiver = CheckpointEngineRegistry.new("nats", bucket_size=1 << 20)
    with pytest.raises(NotImplementedError, match="gateways receive from NATS"):
        anyio.run(receiver.receive_weights)


def test_wrong_backend_or_settings_fail_when_the_trainer_starts() -> None:
    naive = CheckpointEngineConfig(backend="naive")
    with pytest.raises(ValueError, match=r"checkpoint_engine.backend=nats and custom_backend_module"):
        StreamCheckpointManager(config=naive, actor_wg=_ActorGroup([]), replicas=[])
    typo = CheckpointEngineConfig(backend="nats", engine_kwargs={"nats": {"server": "nats://x:4222"}})
    with pytest.raises(ValueError, match=r"unknown nats checkpoint engine settings \['server'\]"):
        StreamCheckpointManager(config=typo, actor_wg=_ActorGroup([]), replicas=[])
    with pytest.raises(ValueError, match="not a torch floating dtype"):
        NatsWeightSettings.from_options({"dtype": "int8"})
    assert NatsWeightSettings.from_options(None).servers == ("nats://127.0.0.1:4222",)
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


def test_through_verls_ray_worker_group_on_cpu(
    nats_server: EmbeddedNatsServer, tiny_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real path minus FSDP: verl's ``RayWorkerGroup`` of two CPU Ray actors (gloo), verl's own
    ``update_weights`` bound with its ONE_TO_ALL non-blocking dispatch, our engine publishing from
    inside rank 0's Ray event loop, and the manager awaiting the ``ObjectRef`` s verl returns."""
    import ray

    config = _verl_config(tmp_path, nats_server.url)
    _, state = _model_state(tiny_model_path)
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[2]))  # workers import tests.*
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ray's own start-up warnings are not ours to judge
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace=f"vw-{secrets.token_hex(4)}")
    try:
        pool = RayResourcePool(process_on_nodes=[2], use_gpu=False, max_colocate_count=1)
        worker = RayClassWithInitArgs(
            cls=ray.remote(_CpuActorWorker), config=config.actor_rollout_ref, model_path=str(tiny_model_path)
        )
        actor_wg: Any = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=worker, device_name="cpu")
        actor_wg.init_model()
        manager = _init_workers(config, actor_wg, replicas=[])

        metrics = manager.update_weights(1)

        assert metrics["stream/policy_version"] == 1.0
        assert actor_wg.export_counts() == [(1, 1), (1, 1)]
        (event,) = _sync_events(nats_server.url, _spec(manager))
        tensors = anyio.run(_download, nats_server.url, event, tmp_path)
        assert list(tensors) == sorted(state)
        assert all(torch.equal(tensors[name], state[name]) for name in state)
    finally:
        ray.shutdown()
