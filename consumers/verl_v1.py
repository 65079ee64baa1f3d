"""verl's v1 trainers fed by the stream: the agent loop manager that fills TransferQueue with its groups.

verl 0.9.1 runs ``python -m verl.trainer.main_ppo`` on its v1 trainers by default
(``trainer.use_v1: true``). ``TaskRunnerV1.init_agent_loop_manager`` (``verl/trainer/main_ppo.py``)
builds the class named by ``actor_rollout_ref.rollout.agent.agent_loop_manager_class`` with
``cls.create(config=, llm_client=, teacher_client=, reward_loop_worker_handles=)`` and asks of it
only that ``generate_sequences`` put the agent-loop outputs into TransferQueue. The trainer
(``verl/trainer/ppo/v1/trainer_base.py``) draws prompts from its dataloader, registers each one's
``uid`` in TransferQueue (tag ``is_prompt``, ``status: pending``), hands the batch to
``generate_sequences`` and returns; its replay buffer (``verl/trainer/ppo/v1/replay_buffer.py``)
then polls TransferQueue until enough prompt groups are ``finished`` and trains on the samples
keyed ``{uid}_{session}_{index}``. :class:`StreamAgentLoopManagerTQ` is that class for the stream:

* **A prompt is a slot.** Each prompt uid the trainer submits is filled by the next GRPO group of
  the next batch announced on ``sg.batches.ready`` (the durable pull consumer of
  :class:`~consumers.verl_adapter.StreamAgentLoopManager`, same settings). Every row of the group
  goes in as ``{uid}_{i}_0`` in exactly the per-sample layout of verl's own
  ``AgentLoopWorkerTQ._agent_loop_postprocess`` (``verl/trainer/ppo/v1/agent_loop_tq.py``), built by
  :func:`consumers.verl_batch.to_jagged_tensordict` (ids, masks, ``rollout_log_probs``,
  ``rm_scores`` with the reward on the last token, multi-modal inputs, routed experts, policy
  versions), ``uid`` the slot's, and the sample tags that agent loop writes (``status``,
  ``prompt_len``, ``response_len``, ``seq_len``, ``global_steps``, ``min_global_steps``,
  ``max_global_steps``). Then the slot's status becomes ``finished``. A group is never split
  and never placed twice; the dataset's prompts are never read (:class:`StreamSlots` is the dataset).
* **Never blocking.** ``generate_sequences`` registers its slots and returns at once; a task on
  the manager's private event loop (a daemon thread) waits for batches and fills slots as they
  arrive. The separate-async trainer keeps training while it waits.
* **Staleness from the recorded versions.** A filled slot's ``global_steps`` tag becomes the step
  that follows the oldest policy version in its group (version ``v`` → step ``v + 1``: the step
  whose rollout ran on the weights of ``update_weights(v)``), so verl's own off-policy bound
  (``trainer.v1.sampler.max_off_policy_threshold`` with ``max_off_policy_strategy: drop``, the
  separate-async trainer's ``ReplayBufferAsync``) judges the stream's groups by the policy that
  sampled them, and refills what it evicts. The sync trainer has no bound (verl treats it as
  on-policy).
* **Acknowledged once placed.** A manifest is acknowledged when its last group is in
  TransferQueue. A manifest that comes again (NATS restarted before the acknowledgement reached
  it) is acknowledged and skipped, never placed twice; a trainer that dies holds what was placed
  in its TransferQueue, lost with it, as verl's own rollouts are. While a batch waits for slots
  its manifest is kept in progress.
* **Failure is loud.** A batch that cannot be read as trajectories (images that do not match,
  a broken parquet) stops the filler: the slots waiting become ``failure`` (verl's replay buffer
  then raises on a batch of failed groups) and the next ``generate_sequences`` raises the cause.

The configuration (one block in docs/batches.md, which the tests run) sets this class, the
rollout name ``stream_gateway`` (:mod:`consumers.verl_rollout`: no rollout engine, weights to
NATS), the ``nats`` checkpoint engine, :class:`StreamSlots` as the dataset and turns validation
off. :meth:`StreamAgentLoopManagerTQ.create` refuses another rollout name: verl would have started
engines that idle through training.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
from torch.utils.data import Dataset

from .parquet import decode_batch
from .verl_adapter import StreamAgentLoopManager, _acknowledge, _get

if TYPE_CHECKING:
    from nats.aio.msg import Msg
    from tensordict import TensorDict

    from .images import ResolvedImage
    from .parquet import BatchManifest
    from .trajectory import Trajectory

__all__ = ["ROLLOUT_NAME", "StreamAgentLoopManagerTQ", "StreamSlots"]

log = logging.getLogger(__name__)

ROLLOUT_NAME = (
    "stream_gateway"  # consumers.verl_rollout.ROLLOUT_NAME (not imported: that module imports verl's workers)
)
PARTITION = "train"
DEFAULT_SLOTS = 1_000_000  # StreamSlots' length without data.train_max_samples
_REMEMBERED_BATCHES = 4096  # batch ids kept to recognise a manifest that comes again


class StreamSlots(Dataset[dict[str, Any]]):
    """verl's dataset for a stream-fed trainer: slots, each filled by one group (``data.custom_cls``).

    verl's dataloader draws ``uid`` s from it; the manager fills each with a group. Its length is
    ``data.train_max_samples`` when set, else :data:`DEFAULT_SLOTS`: it only bounds
    ``steps_per_epoch`` (set ``trainer.total_training_steps``). The constructor takes what
    ``verl.trainer.ppo.utils.create_rl_dataset`` passes and reads none of it.
    """

    def __init__(
        self,
        data_files: Any = None,
        tokenizer: Any = None,
        processor: Any = None,
        config: Any = None,
        max_samples: int = -1,
        **kwargs: Any,
    ) -> None:
        self.size = max_samples if max_samples and max_samples > 0 else DEFAULT_SLOTS

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, Any]:
        # raw_prompt: verl's _fetch_one_gen_batch counts the batch by it; nothing reads its content.
        return {"raw_prompt": [{"role": "user", "content": ""}], "index": index, "data_source": ROLLOUT_NAME}


@dataclass(slots=True)
class _Batch:
    """A batch being placed, one group per slot."""

    msg: Msg
    manifest: BatchManifest
    trajectories: list[Trajectory]
    images: list[list[ResolvedImage]] | None
    groups: deque[list[int]]  # row indices of the groups not yet placed
    last_progress: float = field(default_factory=time.monotonic)


class StreamAgentLoopManagerTQ(StreamAgentLoopManager):
    """verl v1's ``agent_loop_manager_class`` for the stream (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """As :class:`~consumers.verl_adapter.StreamAgentLoopManager` (verl's ``create`` arguments, settings)."""
        super().__init__(*args, **kwargs)
        self._slots: deque[tuple[str, int]] = deque()  # (uid, the trainer's step) waiting for a group
        self._wake: asyncio.Event | None = None
        self._filler: Any = None  # concurrent.futures.Future of the filling task
        self._failure: BaseException | None = None
        self._placed: OrderedDict[str, None] = OrderedDict()  # batch ids wholly placed
        self._slots_lock = threading.Lock()
        self.groups_placed = 0
        self.samples_placed = 0
        self.skipped_again = 0  # manifests that came again after being placed

    @classmethod
    def create(cls, *args: Any, **kwargs: Any) -> StreamAgentLoopManagerTQ:
        """What ``TaskRunnerV1`` calls; refuses a rollout that would idle beside the stream."""
        instance = cls(*args, **kwargs)
        _check_rollout(instance.config)
        return instance

    def generate_sequences(self, prompts: TensorDict | None = None) -> None:  # type: ignore[override]
        """Register the trainer's prompt uids as slots and return; groups fill them as they come."""
        if self._failure is not None:
            raise RuntimeError(f"the stream's filler stopped: {self._failure!r}") from self._failure
        if prompts is None or len(prompts) == 0:
            return
        present = set(prompts.keys())  # a TensorDict has no `in`
        if "validate" in present and bool(_plain(prompts["validate"])):
            raise NotImplementedError(
                "StreamAgentLoopManagerTQ serves training batches only; turn validation off "
                "(trainer.test_freq=-1, trainer.val_before_train=False)"
            )
        import transfer_queue as tq

        uids = [str(uid) for uid in _plain(prompts["uid"])]
        step = int(_plain(prompts["global_steps"])) if "global_steps" in present else 0
        tq.kv_batch_put(keys=uids, partition_id=PARTITION, tags=[{"status": "running"} for _ in uids])
        with self._slots_lock:
            self._slots.extend((uid, step) for uid in uids)
        loop = self._ensure_loop()
        if self._filler is None:
            self._filler = loop.submit(self._fill())
        loop.call_soon(self._notify)

    def close(self) -> None:
        """Stop filling, then close NATS and the private loop (idempotent)."""
        filler, self._filler = self._filler, None
        if filler is not None:
            filler.cancel()
        super().close()

    # -- on the private loop ---------------------------------------------------------------

    def _notify(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def _fill(self) -> None:
        """Fill slots with groups until cancelled; on a fatal error fail the waiting slots."""
        self._wake = asyncio.Event()
        batch: _Batch | None = None
        try:
            while True:
                if not self._slots:
                    await self._idle(batch)
                    continue
                if batch is None:
                    batch = await self._next()
                    if batch is None:
                        continue
                await self._place(batch)
                if not batch.groups:
                    await self._finish(batch)
                    batch = None
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._failure = exc
            log.error("the stream cannot fill verl's prompts: %r", exc)
            await self._fail_waiting()
            if batch is not None:
                with contextlib.suppress(Exception):
                    await batch.msg.nak()
            raise

    async def _idle(self, batch: _Batch | None) -> None:
        """Wait for slots; keep a half-placed batch's manifest from being redelivered meanwhile."""
        assert self._wake is not None
        self._wake.clear()
        if self._slots:
            return
        keep_alive = max(1.0, self.settings.ack_wait_s / 3)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout=keep_alive)
        if batch is not None and time.monotonic() - batch.last_progress >= keep_alive:
            with contextlib.suppress(Exception):
                await batch.msg.in_progress()
            batch.last_progress = time.monotonic()

    async def _next(self) -> _Batch | None:
        """The next batch to place, or ``None`` (nothing yet, or a manifest already placed)."""
        try:
            msg, manifest, data = await self._next_batch()
        except TimeoutError as exc:  # a quiet stream: verl's replay buffer waits, so do we
            log.info("%s", exc)
            return None
        if manifest.batch_id in self._placed:
            log.info(
                "batch %s came again (its acknowledgement was lost): acknowledged, not placed twice", manifest.batch_id
            )
            with contextlib.suppress(Exception):
                await _acknowledge(msg)
            self.skipped_again += 1
            return None
        if len(data) != manifest.size or hashlib.sha256(data).hexdigest() != manifest.sha256:
            raise ValueError(f"batch {manifest.batch_id}: the object does not match its manifest")
        trajectories, uids = decode_batch(data)
        images = await self._resolve_images(trajectories)
        return _Batch(msg, manifest, trajectories, images, deque(_groups(uids)))

    async def _place(self, batch: _Batch) -> None:
        """Fill waiting slots with the batch's groups, one group per slot."""
        import transfer_queue as tq

        while batch.groups:
            with self._slots_lock:
                if not self._slots:
                    return
                uid, step = self._slots.popleft()
            rows = batch.groups.popleft()
            trajectories = [batch.trajectories[i] for i in rows]
            images = None if batch.images is None else [batch.images[i] for i in rows]
            fields, tags = _samples(uid, step, trajectories, images)
            keys = [f"{uid}_{i}_0" for i in range(len(rows))]
            oldest = min(t.min_policy_version for t in trajectories)
            put = functools.partial(tq.kv_batch_put, keys=keys, partition_id=PARTITION, fields=fields, tags=tags)
            await anyio.to_thread.run_sync(put)
            prompt_tag = {"status": "finished", "global_steps": oldest + 1}
            await anyio.to_thread.run_sync(
                functools.partial(tq.kv_put, key=uid, partition_id=PARTITION, tag=prompt_tag)
            )
            self.groups_placed += 1
            self.samples_placed += len(rows)
            batch.last_progress = time.monotonic()

    async def _finish(self, batch: _Batch) -> None:
        """Every group placed: remember the batch, acknowledge its manifest."""
        batch_id = batch.manifest.batch_id
        self._placed[batch_id] = None
        while len(self._placed) > _REMEMBERED_BATCHES:
            self._placed.popitem(last=False)
        try:
            await _acknowledge(batch.msg)
        except RuntimeError as exc:  # it comes again, and is recognised then
            log.warning("batch %s placed, acknowledgement failed: %s", batch_id, exc)
        log.info("batch %s: %d trajectories placed in TransferQueue", batch_id, len(batch.trajectories))

    async def _fail_waiting(self) -> None:
        import transfer_queue as tq

        with self._slots_lock:
            uids = [uid for uid, _ in self._slots]
            self._slots.clear()
        if uids:
            tags = [{"status": "failure"} for _ in uids]
            with contextlib.suppress(Exception):
                await anyio.to_thread.run_sync(lambda: tq.kv_batch_put(keys=uids, partition_id=PARTITION, tags=tags))


def _samples(
    uid: str, step: int, trajectories: list[Trajectory], images: list[list[ResolvedImage]] | None
) -> tuple[TensorDict, list[dict[str, Any]]]:
    """One group's rows in verl v1's per-sample layout, and their TransferQueue tags."""
    from tensordict import NonTensorData, NonTensorStack

    from .verl_batch import to_jagged_tensordict

    fields = to_jagged_tensordict(trajectories, [uid] * len(trajectories), images)
    n = len(trajectories)
    fields["global_steps"] = NonTensorStack.from_list([NonTensorData(step) for _ in range(n)])
    fields["data_source"] = NonTensorStack.from_list([NonTensorData(ROLLOUT_NAME) for _ in range(n)])
    tags = []
    for t in trajectories:
        prompt_len, response_len = t.prompt_length, len(t.token_ids) - t.prompt_length
        tags.append(
            {
                "status": "success",
                "prompt_len": prompt_len,
                "response_len": response_len,
                "seq_len": prompt_len + response_len,
                "global_steps": step,
                "min_global_steps": t.min_policy_version,
                "max_global_steps": t.max_policy_version,
            }
        )
    return fields, tags


def _groups(uids: list[str]) -> list[list[int]]:
    """Row indices of each run of equal uids (a batch's groups are contiguous)."""
    groups: list[list[int]] = []
    previous: str | None = None
    for i, uid in enumerate(uids):
        if groups and uid == previous:
            groups[-1].append(i)
        else:
            groups.append([i])
        previous = uid
    return groups


def _plain(value: Any) -> Any:
    """A TensorDict entry as plain Python: a ``NonTensorData``'s value, a stack's list, a tensor's."""
    from tensordict import NonTensorData

    if isinstance(value, NonTensorData):
        return value.data
    if hasattr(value, "tolist"):
        return value.tolist()
    return value


def _check_rollout(config: Any) -> None:
    """verl starts rollout replicas before the manager exists: refuse ones the stream would leave idle."""
    rollout = _get(_get(config, "actor_rollout_ref"), "rollout")
    name = _get(rollout, "name")
    if config is None or name == ROLLOUT_NAME:
        return
    raise ValueError(
        f"actor_rollout_ref.rollout.name={name!r}: verl has started {name} rollout engines that a trainer fed by "
        f"the stream never asks for a token (their devices idle through training). Set "
        f"actor_rollout_ref.rollout.name={ROLLOUT_NAME} (consumers.verl_rollout: no engine, weights to the gateways)"
    )
