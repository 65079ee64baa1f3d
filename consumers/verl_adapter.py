"""verl's agent loop manager, fed by the stream: each ``generate_sequences`` is the next batch.

verl 0.9.1's PPO trainer (``verl.trainer.ppo.ray_trainer.RayPPOTrainer.init_workers``) loads
the class named by ``actor_rollout_ref.rollout.agent.agent_loop_manager_class`` and builds it
with ``cls.create(config=..., llm_client=..., teacher_client=..., reward_loop_worker_handles=...)``
(synchronously); its training loop then calls ``generate_sequences(gen_batch)`` once per step
and nothing else on it (weights are synced by the trainer's own checkpoint manager, not here).
:class:`StreamAgentLoopManager` does that: it ignores the engine clients and returns the next
batch announced on ``sg.batches.ready`` (a durable pull consumer on ``SG_BATCHES``), its parquet
fetched from the object store and laid out by :func:`consumers.verl_batch.padded_batch`.

Configured from verl's own config, with no environment variables::

    actor_rollout_ref:
      rollout:
        prompt_length: 1024          # the batch is padded to these (verl's defaults follow
        response_length: 2048        #   data.max_prompt_length / data.max_response_length)
        agent:
          agent_loop_manager_class: consumers.verl_adapter.StreamAgentLoopManager
        custom:                      # RolloutConfig's extension point (a free dict)
          stream_gateway:
            nats_url: nats://127.0.0.1:4222
            durable: verl-trainer
            only_adapter: alpha      # optional: train one LoRA adapter (only_base: true for the base model)
            timeout_s: 600
            pad_token_id: 0          # default: the tokenizer's, from actor_rollout_ref.model.path
            nats_auth:               # optional: credentials and TLS, as pipeline.connection.NatsAuth
              user: trainer          #   password: from $STREAM_GATEWAY_NATS_PASSWORD
              tls_ca: /etc/nats/ca.pem

On a Hydra command line both keys are new to verl's schema, so they take a ``+``::

    +actor_rollout_ref.rollout.agent.agent_loop_manager_class=consumers.verl_adapter.StreamAgentLoopManager
    +actor_rollout_ref.rollout.custom.stream_gateway.nats_url=nats://10.0.0.5:4222

Keyword arguments to the constructor override the config (``StreamAgentLoopManager(config, nats_url=...)``).

Deliberate choices:

* **Sync API, private loop.** verl calls ``create`` and ``generate_sequences`` synchronously.
  NATS is asyncio, and its connection must outlive one call, so the manager runs its own event
  loop in a daemon thread (started on first use; :meth:`close` ends it). Nothing connects at
  construction: the class imports and builds without NATS running.
* **Waiting.** With no batch ready, it waits up to ``timeout_s`` (also riding out a NATS that is
  down or restarting), logging ``waiting for a batch from NATS at <url> (stream SG_BATCHES, ...)``
  every ``log_every_s``, then raises :class:`TimeoutError` saying what it waited for.
* **Ack after the batch is built.** The manifest is acknowledged once the ``DataProto`` is ready
  to return. A trainer that dies during the step loses that one batch (it stays in the object
  store, and in the batcher's output directory if it has one); it is never trained on twice.
* **Fitting the trainer's step.** The trainer unions the output with the dataloader's batch
  (``batch.repeat(rollout.n).union(output)``), which requires equal ``uid`` arrays. So when the
  request carries ``uid`` the stream's groups take the request's uids, group for group (the
  stream's own ids stay in ``sg_group_uid``); this needs ``data.train_batch_size * rollout.n ==``
  the batcher's ``batch_size`` and ``rollout.n ==`` its ``group_size``, and a clear
  :class:`ValueError` says so otherwise. The dataloader's prompts are otherwise ignored.
* **One adapter per trainer.** Batches never mix LoRA adapters, and each manifest names its
  adapter (:class:`~consumers.parquet.BatchManifest`). With ``only_adapter: NAME`` (or
  ``only_base: true``) the manager serves only that adapter's batches: it reads through a
  durable consumer of its own, ``<durable>-adapter-<name>`` (``<durable>-base``), and acknowledges
  the other adapters' manifests there untouched, so trainers of different adapters each see
  every manifest and take their own. Without either it serves every batch, as before adapters.
* **Images.** A batch of a vision-language model carries references to its images, not pixels
  (:mod:`consumers.parquet`). They are fetched from the ``sg_images`` bucket, processed again by
  the recorded processor and checked against the pixel digests recorded while sampling
  (:class:`consumers.images.ImageStore`, its cache bounded by ``image_cache_bytes``), then laid
  out as verl lays them out (:mod:`consumers.verl_vision`). A row whose images cannot be rebuilt
  exactly refuses the whole batch with :class:`~consumers.images.ImagesRefused` naming the row and
  why (the manifest is not acknowledged): the batcher has already dropped the rows it could not
  rebuild, so this means the trainer's transformers or Pillow process images differently from
  the gateway's, and a trainer cannot leave one row out of a batch whose groups are fixed.
* **No validation from the stream**: a ``validate`` request raises (set ``trainer.test_freq=-1``
  and ``trainer.val_before_train=False``); stream batches are training data.
* **Which trainers.** verl's legacy PPO/GRPO trainer (``RayPPOTrainer``, ``verl.trainer.main_ppo``
  with ``trainer.use_v1=false``) is the one this serves. verl's v1 trainers (its default) are
  served by :class:`consumers.verl_v1.StreamAgentLoopManagerTQ`, which puts the stream's groups into
  TransferQueue. The one-step-off-policy and fully-async recipes ``await`` the call or use other methods
  (``generate_sequences_single``): not supported. ``start_profile``/``stop_profile`` exist as
  no-ops for the trainers that call them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Self, TypeVar

import anyio
import numpy as np
from pipeline.connection import NatsAuth, close_quietly, split_servers
from pipeline.errors import NatsRefused
from pipeline.subscriber import message_payload

from consumers.errors import ImagesRefused

from ._runner import DurableRunner, PullSpec
from .grouping import AdapterFilter, adapter_filter
from .images import ImageStore
from .parquet import BatchManifest, decode_batch
from .streams import ConsumerStreams

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg
    from nats.js import JetStreamContext
    from verl.protocol import DataProto

    from .images import ResolvedImage
    from .trajectory import Trajectory

__all__ = ["StreamAgentLoopManager", "StreamSettings"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_POLL_S = 1.0
_OBJECT_TIMEOUT_S = 120.0
_ACK_ATTEMPTS = 3
_THREAD_JOIN_S = 5.0


@dataclass(frozen=True, slots=True)
class StreamSettings:
    """Where batches come from and how they are laid out."""

    nats_url: str = "nats://127.0.0.1:4222"  # comma-separated for several servers
    nats_auth: NatsAuth = field(default_factory=NatsAuth)  # credentials and TLS (pipeline.connection)
    names: ConsumerStreams = field(default_factory=ConsumerStreams)
    durable: str = "verl-trainer"  # with an adapter filter, the consumer is named after it too (consumer_name)
    only_adapter: str | None = None  # serve only this LoRA adapter's batches
    only_base: bool = False  # serve only the base model's batches
    timeout_s: float = 600.0  # the longest one generate_sequences waits for a batch
    log_every_s: float = 30.0
    prompt_length: int = 1024
    response_length: int = 2048
    pad_token_id: int = 0
    ack_wait_s: float = 120.0  # fetch to ack of one manifest
    image_cache_bytes: int = 256 << 20  # processed images kept between batches (consumers.images)
    connect_timeout_s: float = 2.0

    def __post_init__(self) -> None:
        _ = self.adapters  # checks the adapter filter

    @property
    def adapters(self) -> AdapterFilter | None:
        """The one adapter whose batches are served (``only_adapter``/``only_base``); ``None``: every batch."""
        return adapter_filter(self.only_adapter, self.only_base)

    @property
    def consumer_name(self) -> str:
        """The durable consumer read: ``durable``, or with an adapter filter ``<durable>-adapter-<name>``/``-base``."""
        adapters = self.adapters
        return self.durable if adapters is None else adapters.consumer_name(self.durable)

    @classmethod
    def from_verl_config(cls, config: Any, **overrides: Any) -> StreamSettings:
        """Settings from a verl config (see the module docstring), then ``overrides``."""
        rollout = _get(_get(config, "actor_rollout_ref"), "rollout")
        custom = dict(_get(_get(rollout, "custom"), "stream_gateway") or {})
        values: dict[str, Any] = {}
        for name in ("prompt_length", "response_length"):
            if _get(rollout, name) is not None:
                values[name] = int(_get(rollout, name))
        names_fields = {f.name for f in fields(ConsumerStreams)}
        stream_names = {k: custom.pop(k) for k in list(custom) if k in names_fields}
        known = {f.name for f in fields(cls)}
        unknown = set(custom) - known
        if unknown:
            raise ValueError(
                f"unknown stream_gateway settings {sorted(unknown)}; known: {sorted(known | names_fields)}"
            )
        if "nats_auth" in custom and not isinstance(custom["nats_auth"], NatsAuth):
            custom["nats_auth"] = NatsAuth.from_options(custom["nats_auth"])
        values |= custom | overrides
        if stream_names:
            values["names"] = replace(values.get("names", ConsumerStreams()), **stream_names)
        if "pad_token_id" not in values and config is not None:
            values["pad_token_id"] = _pad_token_id(_get(config, "actor_rollout_ref"))
        return cls(**values)


class StreamAgentLoopManager:
    """An ``AgentLoopManager`` for verl whose sequences come from the stream (module docstring)."""

    def __init__(
        self,
        config: Any = None,
        llm_client: Any = None,
        teacher_client: Any = None,
        reward_loop_worker_handles: Any = None,
        *,
        settings: StreamSettings | None = None,
        **overrides: Any,
    ) -> None:
        # The engine clients are accepted because verl passes them; a stream needs none.
        self.config = config
        self.settings = settings if settings is not None else StreamSettings.from_verl_config(config, **overrides)
        self._loop: _LoopThread | None = None
        self._nc: Client | None = None
        self._js: JetStreamContext | None = None
        self._subscription: Any = None
        self._images: ImageStore | None = None
        self._lock = threading.Lock()

    @classmethod
    def create(cls, *args: Any, **kwargs: Any) -> Self:
        """What verl's trainer calls: ``create(config=, llm_client=, teacher_client=, reward_loop_worker_handles=)``."""
        return cls(*args, **kwargs)

    def generate_sequences(self, prompts: DataProto | None = None) -> DataProto:
        """The next ready batch as a ``DataProto`` (waits up to ``timeout_s``; see the module docstring)."""
        from .verl_batch import padded_batch, to_data_proto

        if prompts is not None and prompts.meta_info.get("validate", False):
            raise NotImplementedError(
                "StreamAgentLoopManager serves training batches only; turn validation off "
                "(trainer.test_freq=-1, trainer.val_before_train=False)"
            )
        settings = self.settings
        with self._lock:
            loop = self._ensure_loop()
            started = time.monotonic()
            msg, manifest, data = loop.call(self._next_batch())
            waited = time.monotonic() - started
            try:
                if len(data) != manifest.size or hashlib.sha256(data).hexdigest() != manifest.sha256:
                    raise ValueError(f"batch {manifest.batch_id}: the object does not match its manifest")
                _check_lengths(manifest, settings)
                trajectories, uids = decode_batch(data)
                images = loop.call(self._resolve_images(trajectories))
                output = to_data_proto(
                    padded_batch(
                        trajectories,
                        uids,
                        prompt_length=settings.prompt_length,
                        response_length=settings.response_length,
                        pad_token_id=settings.pad_token_id,
                        images=images,
                    )
                )
                _fit_to_request(output, prompts, manifest, trajectories)
            except BaseException:
                with contextlib.suppress(Exception):  # the error that matters is the one raised
                    loop.call(msg.nak())
                raise
            loop.call(_acknowledge(msg))
        output.meta_info["timing"] = {"stream/wait_s": waited, "stream/total_s": time.monotonic() - started}
        output.meta_info["sg_batch_id"] = manifest.batch_id
        log.info("batch %s: %d trajectories after %.1f s", manifest.batch_id, len(trajectories), waited)
        return output

    def start_profile(self, **kwargs: Any) -> None:
        """No-op: there is no rollout engine here to profile."""

    def stop_profile(self) -> None:
        """No-op: there is no rollout engine here to profile."""

    def close(self) -> None:
        """Close the NATS connection and stop the private loop; idempotent."""
        with self._lock:
            loop, self._loop = self._loop, None
            if loop is None:
                return
            try:
                loop.call(self._disconnect())
            finally:
                loop.stop()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- on the private loop ---------------------------------------------------------------

    def _ensure_loop(self) -> _LoopThread:
        if self._loop is None:
            self._loop = _LoopThread()
        return self._loop

    async def _next_batch(self) -> tuple[Msg, BatchManifest, bytes]:
        import nats.errors

        settings, names = self.settings, self.settings.names
        deadline = time.monotonic() + settings.timeout_s
        next_log = time.monotonic() + settings.log_every_s
        problem = "no batch was published"
        if (adapters := settings.adapters) is not None:
            problem = f"no batch of {adapters} was published"
        while True:
            now = time.monotonic()
            if now >= next_log:
                next_log = now + settings.log_every_s
                log.warning(
                    "waiting for a batch from NATS at %s (stream %s, subject %s, durable %s): %.0f s of %.0f s (%s)",
                    settings.nats_url,
                    names.batches,
                    names.batch_subject,
                    settings.consumer_name,
                    settings.timeout_s - (deadline - now),
                    settings.timeout_s,
                    problem,
                )
            remaining = deadline - now
            if remaining <= 0:
                raise TimeoutError(
                    f"no training batch from NATS at {settings.nats_url} (stream {names.batches}, subject "
                    f"{names.batch_subject}, durable consumer {settings.consumer_name}) within "
                    f"{settings.timeout_s:g} s: "
                    f"{problem}. Is `stream-gateway batch` running against this server, and are trajectories flowing?"
                )
            try:
                if self._subscription is None:
                    await self._connect()
                messages = await self._runner.fetch(self._subscription, 1, max(0.01, min(remaining, _POLL_S)))
                if not messages:
                    continue
            except NatsRefused:  # wrong credentials or TLS: waiting would not help
                raise
            except (OSError, nats.errors.Error) as exc:  # down, restarting, or gone: reconnect and wait on
                problem = f"NATS unavailable: {exc!r}"
                await self._disconnect()
                await anyio.sleep(min(_POLL_S, max(0.0, deadline - time.monotonic())))
                continue
            msg = messages[0]
            loaded = await self._load(msg)
            if loaded is not None:
                return msg, *loaded

    async def _resolve_images(self, trajectories: list[Trajectory]) -> list[list[ResolvedImage]] | None:
        """Every row's images, rebuilt and checked (``None``: the batch has none)."""
        if not any(t.images for t in trajectories):
            return None
        if self._images is None:
            assert self._js is not None  # connected: a batch was just read
            settings = self.settings
            self._images = ImageStore(self._js, settings.names.image_bucket, cache_bytes=settings.image_cache_bytes)
        try:
            return await self._images.resolve_all(trajectories)
        except ImagesRefused as exc:
            log.error("a batch cannot be trained on: %s", exc)
            raise

    async def _load(self, msg: Msg) -> tuple[BatchManifest, bytes] | None:
        """The manifest and the parquet; ``None`` when there is none to serve (logged, or retried)."""
        import nats.errors
        from nats.js.errors import ObjectNotFoundError

        assert self._js is not None
        try:
            manifest = BatchManifest.decode(await message_payload(msg, self._js))
            adapters = self.settings.adapters
            if adapters is not None and not adapters.takes(manifest.adapter):  # another adapter's trainer's
                log.debug("batch %s is not of %s: skipped", manifest.batch_id, adapters)
                await msg.ack()
                return None
            await msg.in_progress()
            with anyio.fail_after(_OBJECT_TIMEOUT_S):
                store = await self._js.object_store(manifest.bucket)
                result = await store.get(manifest.object)
        except (ValueError, LookupError, ObjectNotFoundError) as exc:  # unreadable, or its object is gone
            log.error("skipping batch manifest %s: %s", msg.metadata.sequence.stream, exc)
            with contextlib.suppress(nats.errors.Error):
                await msg.term()
            return None
        except (OSError, nats.errors.Error) as exc:  # NATS trouble: it comes again
            log.warning("reading batch manifest %s failed (%r); retrying", msg.metadata.sequence.stream, exc)
            with contextlib.suppress(nats.errors.Error):
                await msg.nak()
            return None
        return manifest, bytes(result.data or b"")

    @property
    def _runner(self) -> DurableRunner:
        """The shared pull consumer (:mod:`consumers._runner`): one manifest at a time, this
        trainer its consumer's sole reader, a connection away ends the fetch (this loop reconnects)."""
        settings, names = self.settings, self.settings.names
        spec = PullSpec(
            stream=names.batches,
            subjects=names.batch_subject,
            durable=settings.consumer_name,
            ack_wait_s=settings.ack_wait_s,
            max_ack_pending=1,
            fetch_timeout_s=_POLL_S,
            sole_reader=True,
            ride_out_disconnects=False,
        )
        servers = split_servers(settings.nats_url)
        return DurableRunner(spec, servers=servers, auth=settings.nats_auth, names=names, role="verl", log=log)

    async def _connect(self) -> None:
        async def quiet(exc: Exception) -> None:  # reported by the wait loop instead
            log.debug("nats: %r", exc)

        runner = self._runner
        nc, js = await runner.open(
            connect_timeout=self.settings.connect_timeout_s,
            max_reconnect_attempts=2,
            reconnect_time_wait=0.2,
            error_cb=quiet,
        )
        try:
            self._subscription = await runner.bind(js)
        except BaseException:
            await close_quietly(nc)
            raise
        self._nc, self._js = nc, js

    async def _disconnect(self) -> None:
        nc, self._nc, self._js, self._subscription = self._nc, None, None, None
        self._images = None  # bound to the connection's JetStream context
        if nc is not None:
            await close_quietly(nc)


async def _acknowledge(msg: Msg) -> None:
    """``ack_sync``, retried: a batch handed to the trainer must not come again."""
    import nats.errors

    for attempt in range(_ACK_ATTEMPTS):
        try:
            await msg.ack_sync(timeout=5)
            return
        except (OSError, nats.errors.Error) as exc:
            if attempt == _ACK_ATTEMPTS - 1:
                raise RuntimeError(f"could not acknowledge a batch manifest (it would come again): {exc!r}") from exc
            await anyio.sleep(1)


def _check_lengths(manifest: BatchManifest, settings: StreamSettings) -> None:
    """A batch cut for longer prompts or responses than this trainer pads to is refused up front,
    naming both settings (it stays in the stream for a trainer that fits it)."""
    if manifest.prompt_length <= settings.prompt_length and manifest.response_length <= settings.response_length:
        return
    raise ValueError(
        f"batch {manifest.batch_id} was cut for prompts of up to {manifest.prompt_length} and responses of up "
        f"to {manifest.response_length} tokens (the batcher's --prompt-length/--response-length), but this "
        f"trainer pads to {settings.prompt_length} and {settings.response_length} "
        "(actor_rollout_ref.rollout.prompt_length/response_length): set the trainer's at least as long"
    )


def _fit_to_request(
    output: DataProto, prompts: DataProto | None, manifest: BatchManifest, trajectories: list[Trajectory]
) -> None:
    """Give the stream's groups the request's uids (see the module docstring), in place."""
    if prompts is None or len(prompts) == 0 or "uid" not in prompts.non_tensor_batch:
        return
    wanted = prompts.non_tensor_batch["uid"]
    ours = output.non_tensor_batch["uid"]
    if len(wanted) != len(ours) or _runs(wanted) != _runs(ours):
        raise ValueError(
            f"the trainer asked for {len(wanted)} sequences in groups of {_runs(wanted)[:1] or [0]} "
            f"(data.train_batch_size x actor_rollout_ref.rollout.n), but batch {manifest.batch_id} holds "
            f"{len(ours)} in groups of {manifest.group_size}: set the batcher's batch_size to {len(wanted)} and "
            "group_size to rollout.n, or the trainer's train_batch_size to batch_size / group_size"
        )
    output.non_tensor_batch["sg_group_uid"] = ours.copy()
    remapped = np.empty(len(ours), dtype=object)
    remapped[:] = list(wanted)
    output.non_tensor_batch["uid"] = remapped


def _runs(values: Any) -> list[int]:
    """Lengths of the runs of equal consecutive values."""
    runs: list[int] = []
    previous = object()
    for value in values:
        if runs and value == previous:
            runs[-1] += 1
        else:
            runs.append(1)
        previous = value
    return runs


def _get(config: Any, key: str) -> Any:
    """``config[key]`` for dicts and OmegaConf configs alike; ``None`` when absent."""
    if config is None:
        return None
    if hasattr(config, "get"):
        return config.get(key)
    return getattr(config, key, None)


def _pad_token_id(actor_rollout_ref: Any) -> int:
    """The pad id of the model's tokenizer, as verl's agent loop pads with; 0 if it cannot be read."""
    model = _get(actor_rollout_ref, "model")
    path = _get(model, "path")
    if not path:
        return 0
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=bool(_get(model, "trust_remote_code")))
    except (OSError, ValueError) as exc:
        log.warning("cannot load the tokenizer of %s (%r): padding with 0; set stream_gateway.pad_token_id", path, exc)
        return 0
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return int(pad) if pad is not None else 0


class _LoopThread:
    """An asyncio loop of our own in a daemon thread (never blocks interpreter exit)."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="stream-gateway-verl", daemon=True)
        self._thread.start()

    def call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run ``coroutine`` on the loop and wait for its result; interrupting the wait cancels it."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coroutine`` on the loop without waiting for it."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    def call_soon(self, callback: Callable[[], object]) -> None:
        """Call ``callback`` on the loop's thread."""
        self._loop.call_soon_threadsafe(callback)

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=_THREAD_JOIN_S)
        if not self._thread.is_alive():
            self._loop.close()
