"""The ``transformers`` engine: a real Hugging Face causal LM, batching concurrent requests.

Why a hand-written batch loop rather than ``model.generate`` or transformers' continuous
batching: every request needs its own temperature, top-p, top-k and seed, the logprobs of exactly
the sampled ids, and the ability to join or leave the batch at any step. ``generate`` fixes the
batch up front; the continuous-batching manager shares one generation config and needs paged
attention kernels. The loop here is small:

* One worker thread owns the model, so forward passes never run on the event loop. The model
  and every forward pass over the batch are :class:`~._hf_model.HfModel`'s; this module decides
  which rows run, what they sample, and when weights change.
* New requests are prefilled one at a time, then merged into the running batch. The batch's
  KV cache is left-padded to a common length; each row has its own attention mask and
  position ids, exactly as batched ``generate`` does with left padding.
* A prefill borrows the longest prefix a recent prompt shares with it from the prefix cache
  (:mod:`._prefix_cache`, ``--prefix-cache-mb``): an agent's next turn runs the forward pass over
  its new tokens only.
* Every step decodes one token for every row, samples with per-row parameters
  (:mod:`._sampling`), and hands all steps to the event loop with one ``call_soon_threadsafe``.
* Finished or aborted rows are dropped from the cache, and padding columns no row needs any
  more are trimmed.

Isolation (issue 43): whatever one request brings (a grammar the tokenizer cannot follow, scores
that are not finite, an adapter that fails), the fault is that request's: it ends with
:class:`~stream_gateway._errors.SequenceFailed` and leaves the batch, and every other row samples
on. A fault of the loop itself (a forward pass that raised) fails the rows of that batch and the
loop goes on with a fresh one, counted as a recovery in :meth:`TransformersEngine.statistics`
(``/health`` shows it); only an exception that is not an ``Exception`` ends the worker.

Aborting is a flag the worker checks before every step; closing the iterator returned by
:meth:`TransformersEngine.generate` sets it, so a client that goes away frees its row at the
next step.

Weight updates (:meth:`TransformersEngine.update_weights`) are checked, converted to the model's
dtype and moved to its device on the caller's side; the worker applies them between two decode
steps, whether or not the batch is full: an in-memory copy into the parameters, then the KV cache
of every running row is recomputed under the new weights (one left-padded prefill). Rows are never
dropped or restarted; their next token is sampled from the new weights, and its logprob equals a
forward pass of the new weights over the whole sequence (which keeping the old cache would not
give). Every step carries the version of the weights that sampled it.

With ``recompute_on_update=False`` (``--kv-cache-on-update keep``) the cache is kept: decoding
pauses for the copy alone, and the tokens that rows in flight sample after the update come from
the new weights attending to keys and values the old weights computed for earlier positions. They
are labelled with the new version (it sampled them) but their logprobs are not a forward pass of
any one version over the whole sequence: importance ratios over them are approximate (what
systems that keep the cache across updates accept). Requests admitted after the update are exact.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import secrets
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np
import torch
from pipeline.vision import ProcessedImage, VisionProcessor
from transformers import PreTrainedTokenizerBase

from stream_gateway._errors import AdapterRefused, Conflict, EngineError, EngineUnavailable, SequenceFailed
from stream_gateway.constraints import TokenMask, grammar_tokenizer
from stream_gateway.engines._base import (
    EngineStatistics,
    EngineStep,
    ExpertShape,
    SamplingParams,
    UpstreamControl,
    WeightUpdateReport,
    merge_steps,
)
from stream_gateway.engines._hf_model import Batch, HfModel, Row, end_of_turn_ids
from stream_gateway.engines._sampling import sample_batch
from stream_gateway.engines._weights import check_tensors, read_checkpoint
from stream_gateway.lora import LoraWeights, read_adapter

if TYPE_CHECKING:
    from stream_gateway._settings import Settings

__all__ = ["TransformersEngine", "create_engine", "end_of_turn_ids", "engine_options"]

log = logging.getLogger(__name__)

_STOP = object()


@dataclass(slots=True)
class _WeightUpdate:
    tensors: dict[str, torch.Tensor]  # already checked, on the model's device and in its dtype
    policy_version: int
    done: asyncio.Future[WeightUpdateReport]
    loop: asyncio.AbstractEventLoop


@dataclass(slots=True)
class _AdapterUpdate:
    name: str
    weights: LoraWeights  # already checked against the base
    policy_version: int
    done: asyncio.Future[WeightUpdateReport]
    loop: asyncio.AbstractEventLoop


@dataclass(slots=True)
class _AdapterUnload:
    name: str
    done: asyncio.Future[None]
    loop: asyncio.AbstractEventLoop


class TransformersEngine:
    """A Hugging Face causal LM served with continuous batching on one worker thread."""

    name = "transformers"
    remote = False
    constrained_decoding = True
    upstreams: UpstreamControl | None = None

    def __init__(
        self,
        model: str | Path,
        *,
        served_model_name: str | None = None,
        max_batch_size: int = 16,
        max_model_len: int | None = None,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        num_threads: int | None = None,
        recompute_on_update: bool = True,
        routed_experts: bool = True,
        loras: Mapping[str, str] | None = None,
        max_loras: int = 8,
        prefix_cache_mb: int = 1024,
    ) -> None:
        self._model_path = str(model)
        self.model_id = served_model_name or Path(self._model_path).name or self._model_path
        self._max_batch_size = max_batch_size
        self._requested_max_len = max_model_len
        self._device = torch.device(device)
        self._dtype = dtype
        self._num_threads = num_threads
        self._recompute_on_update = recompute_on_update
        self._record_routes = routed_experts
        self._lora_dirs = dict(loras or {})
        self._max_loras = max_loras
        self._prefix_cache_bytes = prefix_cache_mb << 20
        self.policy_version = 0
        self.max_model_len = max_model_len or 0
        self.tokenizer: PreTrainedTokenizerBase
        self._m: HfModel  # the model and its forward passes, once loaded (engines/_hf_model.py)
        self._inbox: queue.SimpleQueue[Row | _WeightUpdate | _AdapterUpdate | _AdapterUnload | object] = (
            queue.SimpleQueue()
        )
        self._backlog: deque[Row] = deque()  # taken from the inbox, waiting for a free row
        self.experts: ExpertShape | None = None
        self.vision: VisionProcessor | None = None  # a vision-language model's image processor
        self._adapter_versions: dict[str, int] = {}  # LoRA adapters (stream_gateway.lora): name -> version
        self.adapters: Mapping[str, int] = self._adapter_versions
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._recoveries = 0
        self._last_fault: str | None = None
        self._prefilling: Row | None = None
        self._active = 0
        self._waiting = 0
        self._total_requests = 0
        self._total_tokens = 0

    # -- lifecycle -------------------------------------------------------------------------

    async def __aenter__(self) -> TransformersEngine:
        await anyio.to_thread.run_sync(self._load)
        self._thread = threading.Thread(target=self._run, name=f"engine-{self.model_id}", daemon=True)
        self._thread.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._thread is not None:
            self._inbox.put(_STOP)
            thread = self._thread
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(thread.join, 30.0)
            self._thread = None

    def _load(self) -> None:
        m = self._m = HfModel.load(
            self._model_path,
            device=self._device,
            dtype=self._dtype,
            num_threads=self._num_threads,
            max_model_len=self._requested_max_len,
            loras=self._lora_dirs,
            max_loras=self._max_loras,
            routed_experts=self._record_routes,
            prefix_cache_bytes=self._prefix_cache_bytes,
        )
        self.tokenizer, self.max_model_len = m.tokenizer, m.max_model_len
        self.experts, self.vision = m.experts, m.vision
        self._adapter_versions.update(dict.fromkeys(self._lora_dirs, 0))

    # -- public API ------------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        affinity: str | None = None,
        images: Sequence[ProcessedImage] = (),
        script: Sequence[int] | None = None,
    ) -> AsyncGenerator[EngineStep, None]:
        """Queue a request and yield its steps as the worker samples them (``images``: a
        vision-language model's, in the order of their placeholders in ``prompt_ids``; ``script``:
        the output ids to emit instead of drawing them, see :mod:`.scripted`)."""
        if self._thread is None or not self._thread.is_alive():
            raise EngineUnavailable("the transformers engine is not running") from self._failure
        generator = torch.Generator()
        generator.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))
        stop_ids = params.stop_token_ids if params.ignore_eos else params.stop_token_ids | self._m.eos_ids
        request = Row(
            request_id=request_id,
            prompt_ids=list(prompt_ids),
            params=params,
            loop=asyncio.get_running_loop(),
            outbox=asyncio.Queue(),
            generator=generator,
            stop_ids=stop_ids,
            images=tuple(images),
            script=script,
        )
        self._waiting += 1
        self._total_requests += 1
        self._inbox.put(request)
        outbox = request.outbox
        held: EngineStep | BaseException | None = None  # taken from the queue but not merged
        try:
            while True:
                item = held if held is not None else await outbox.get()
                held = None
                if isinstance(item, SequenceFailed):
                    raise item
                if isinstance(item, BaseException):
                    raise EngineError(f"the transformers engine failed: {item}") from item
                # Steps that waited (the event loop was busy) go out together: one update, one frame.
                steps = [item]
                while item.finish_reason is None and not outbox.empty():
                    following = outbox.get_nowait()
                    if isinstance(following, BaseException) or following.policy_version != item.policy_version:
                        held = following
                        break
                    steps.append(following)
                    item = following
                yield item if len(steps) == 1 else merge_steps(steps)
                if item.finish_reason is not None:
                    return
        finally:
            # Synchronous on purpose: this runs even when the consumer is being cancelled.
            request.aborted = True

    async def update_weights(self, tensors: Mapping[str, torch.Tensor], policy_version: int) -> WeightUpdateReport:
        """Check ``tensors``, then copy them into the model between two decode steps.

        Raises :class:`~._base.WeightsRejected` before anything changes for unknown names or
        wrong shapes. Requests in flight continue on the new weights.
        """
        if self._thread is None or not self._thread.is_alive():
            raise EngineUnavailable("the transformers engine is not running") from self._failure
        check_tensors(self._m.targets, tensors)
        staged = await anyio.to_thread.run_sync(self._stage, tensors)
        loop = asyncio.get_running_loop()
        update = _WeightUpdate(staged, policy_version, loop.create_future(), loop)
        self._inbox.put(update)
        return await update.done

    async def update_adapter(self, name: str, weights: LoraWeights, policy_version: int) -> WeightUpdateReport:
        """Load version ``policy_version`` of LoRA adapter ``name`` (a new name adds an adapter)
        between two decode steps; the rows it serves continue on it (their KV cache recomputed
        under it, as for the base's updates), every other row as before.

        Raises :class:`~stream_gateway.lora.AdapterRefused` (nothing changed) for an adapter the
        base cannot take or one too many, and ``ValueError`` on an engine started without LoRA.
        """
        if self._thread is None or not self._thread.is_alive():
            raise EngineUnavailable("the transformers engine is not running") from self._failure
        if self._m.bank is None:
            raise AdapterRefused("unsupported", "this engine was started without LoRA adapters (--lora NAME=DIR)")
        loop = asyncio.get_running_loop()
        update = _AdapterUpdate(name, weights, policy_version, loop.create_future(), loop)
        self._inbox.put(update)
        return await update.done

    async def unload_adapter(self, name: str) -> None:
        """Remove LoRA adapter ``name`` between two decode steps (vLLM's and SGLang's
        ``unload_lora_adapter``).

        Refused while a request uses it, queued or running: :class:`~stream_gateway._errors.Conflict`
        (409), nothing changed; unload it once they have finished (a remote engine unloads an old
        version only once its own requests on it are done). KeyError for a name not loaded.
        """
        if self._thread is None or not self._thread.is_alive():
            raise EngineUnavailable("the transformers engine is not running") from self._failure
        if self._m.bank is None or name not in self._adapter_versions:
            raise KeyError(name)
        loop = asyncio.get_running_loop()
        unload = _AdapterUnload(name, loop.create_future(), loop)
        self._inbox.put(unload)
        await unload.done

    async def load_adapter(self, name: str, path: str, policy_version: int) -> WeightUpdateReport:
        """:meth:`update_adapter` with the PEFT adapter directory ``path``."""
        weights = await anyio.to_thread.run_sync(read_adapter, path)
        return await self.update_adapter(name, weights, policy_version)

    async def load_weights(self, path: str, policy_version: int) -> WeightUpdateReport:
        """:meth:`update_weights` with the ``*.safetensors`` files of the directory ``path``."""
        tensors = await anyio.to_thread.run_sync(read_checkpoint, path)
        return await self.update_weights(tensors, policy_version)

    def _stage(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # Conversion and device transfer happen here, off the worker: its pause is a plain copy.
        staged = {}
        for name, tensor in tensors.items():
            target = self._m.targets[name]
            staged[name] = tensor.to(device=target.device, dtype=target.dtype).contiguous()
        return staged

    def statistics(self) -> EngineStatistics:
        """A snapshot of the engine's load."""
        return EngineStatistics(
            active_requests=self._active,
            waiting_requests=self._waiting,
            total_requests=self._total_requests,
            total_generated_tokens=self._total_tokens,
            running=self._thread is not None and self._thread.is_alive(),
            recoveries=self._recoveries,
            last_fault=self._last_fault,
        )

    # -- worker thread ---------------------------------------------------------------------

    def _run(self) -> None:
        batch = Batch()
        try:
            with torch.inference_mode():
                while True:
                    try:
                        if not self._admit(batch):
                            return
                        if batch.rows:
                            self._decode(batch)
                    except Exception as exc:  # the loop's own fault: fail this batch, go on with a fresh one
                        batch = self._recover(batch, exc)
        except BaseException as exc:  # tell every request there is, then die loudly
            self._failure = exc
            log.exception("transformers engine worker crashed")
            waiting = list(batch.rows) + list(self._backlog)
            if self._prefilling is not None:
                waiting.append(self._prefilling)
            while True:
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if isinstance(item, Row):
                    waiting.append(item)
                elif isinstance(item, _WeightUpdate | _AdapterUpdate | _AdapterUnload):
                    item.loop.call_soon_threadsafe(_resolve, item.done, exc)
            for row in waiting:
                row.loop.call_soon_threadsafe(row.outbox.put_nowait, exc)
            raise

    def _recover(self, batch: Batch, exc: Exception) -> Batch:
        """Fail the requests of a batch whose step raised; the next batch starts empty."""
        self._recoveries += 1
        self._last_fault = f"{type(exc).__name__}: {exc}"[:300]
        log.exception("transformers engine: a step failed; its %d requests end with an error and the engine "
                      "goes on (recovery %d)", len(batch.rows), self._recoveries)  # fmt: skip
        rows = list(batch.rows)
        if self._prefilling is not None:
            rows.append(self._prefilling)
            self._prefilling = None
        for row in rows:  # an exception each: each is raised in its own request's task
            self._active -= 1
            failed = SequenceFailed(f"The engine failed while serving this request: {self._last_fault}")
            row.loop.call_soon_threadsafe(row.outbox.put_nowait, failed)
        self._m.discard_routes()
        return Batch()

    def _admit(self, batch: Batch) -> bool:
        """Take new work from the inbox; block only when there is nothing to do. False means stop.

        Weight updates are applied as soon as they arrive, also when the batch is full; requests
        wait in the backlog until a row is free.
        """
        while True:
            try:
                # Idle: sleep until work arrives (shutdown sends a sentinel). Busy: never wait.
                item = self._inbox.get_nowait() if batch.rows or self._backlog else self._inbox.get()
            except queue.Empty:
                break
            if item is _STOP:
                return False
            if isinstance(item, _WeightUpdate):
                self._apply_weights(batch, item)
            elif isinstance(item, _AdapterUpdate):
                self._apply_adapter(batch, item)
            elif isinstance(item, _AdapterUnload):
                self._unload_adapter(batch, item)
            elif isinstance(item, Row):
                self._backlog.append(item)
            else:
                raise TypeError(f"the engine's inbox holds {item!r}")
        while self._backlog and len(batch.rows) < self._max_batch_size:
            item = self._backlog.popleft()
            self._waiting -= 1
            if item.aborted:
                continue
            self._active += 1
            self._prefilling = item
            try:
                self._prefill(batch, item)
            except Exception as exc:  # e.g. an id outside the vocabulary: fail this request only
                self._active -= 1
                item.loop.call_soon_threadsafe(item.outbox.put_nowait, exc)
            self._prefilling = None
        return True

    def _prefill(self, batch: Batch, request: Row) -> None:
        m = self._m
        constraint = request.params.constraint
        if constraint is not None:  # in the worker: building a large grammar's first mask takes a while
            vocab = m.vocab_size
            request.mask = TokenMask(constraint, grammar_tokenizer(self.tokenizer, vocab, m.eos_ids), vocab)
        logits, cache, routes = m.prefill(request)
        finished = self._emit([request], logits, [request.params], [request.generator], routes)
        if finished[0]:
            return
        m.merge(batch, request, cache)

    def _decode(self, batch: Batch) -> None:
        rows = batch.rows
        logits, routes = self._m.decode(batch)
        finished = self._emit(rows, logits, [r.params for r in rows], [r.generator for r in rows], routes)
        keep = [i for i, (r, done) in enumerate(zip(rows, finished, strict=True)) if not (done or r.aborted)]
        if len(keep) == len(rows):
            return
        # Finished rows were already counted out by _emit; aborted ones leave here.
        self._active -= sum(1 for r, done in zip(rows, finished, strict=True) if r.aborted and not done)
        self._m.keep_rows(batch, keep)

    def _emit(
        self,
        rows: list[Row],
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator],
        routes: list[np.ndarray] | None = None,
    ) -> list[bool]:
        """Sample one token per row, deliver the steps, and say which rows finished; ``routes``:
        each row's experts for the positions this forward pass ran (mixtures of experts)."""
        # Sampling is per-row Python work on [rows, vocab]; doing it on the CPU keeps the
        # per-request generators (CPU) and the result lists cheap on any device.
        logits = logits.float().cpu()
        faults, forced = _constrain(rows, logits)
        # One reduction per step: a row's peak is NaN if any score is, -inf if every score is.
        unusable = ~torch.isfinite(logits.amax(dim=1))
        if bool(unusable.any()):
            for i in unusable.nonzero().flatten().tolist():
                faults.setdefault(i, "the model's scores for it are not finite")
        if faults:  # sampled like the rest (so one row cannot fail the draw), then dropped
            logits[list(faults)] = 0.0
        sampled = sample_batch(logits, params, generators, forced)
        finished: list[bool] = []
        deliveries: list[tuple[Row, EngineStep]] = []
        for i, row in enumerate(rows):
            token = sampled.token_ids[i]
            if row.mask is not None and i not in faults:
                try:
                    row.mask.advance(token)
                except Exception as exc:
                    faults[i] = str(exc)
            if i in faults:
                self._fail_row(row, faults[i])
                finished.append(True)
                continue
            row.generated += 1
            row.output_ids.append(token)
            row.pending_token = token
            reason: Any = None
            if token in row.stop_ids:
                reason = "stop"
            elif row.generated >= row.params.max_tokens or row.length + 1 >= self.max_model_len:
                reason = "length"
            top = sampled.top_logprobs[i]
            adapter = row.params.adapter
            step = EngineStep(
                (token,),
                (sampled.logprobs[i],),
                (top,) if top is not None else None,
                reason,
                self._adapter_versions[adapter] if adapter is not None else self.policy_version,
                None,
                routes[i] if routes is not None else None,
                cached_prompt_tokens=row.cached if reason is not None else None,
            )
            finished.append(reason is not None)
            if reason is not None:
                self._active -= 1  # before the last step is delivered, so statistics never lag it
            if not row.aborted:
                deliveries.append((row, step))
        self._total_tokens += len(rows)
        if deliveries:
            rows[0].loop.call_soon_threadsafe(_deliver, deliveries)
        return finished

    def _fail_row(self, row: Row, why: str) -> None:
        """End one request with :class:`SequenceFailed`; the batch drops its row at this step."""
        self._active -= 1
        log.warning("request %s fails alone: %s", row.request_id, why)
        failed = SequenceFailed(f"The engine could not go on with this request: {why}")
        row.loop.call_soon_threadsafe(row.outbox.put_nowait, failed)

    def _apply_weights(self, batch: Batch, update: _WeightUpdate) -> None:
        started = time.perf_counter()
        try:
            self._m.copy_weights(update.tensors)  # synchronized: on a GPU a copy is queued, not done
            copied = time.perf_counter()
            previous, self.policy_version = self.policy_version, update.policy_version
            in_flight = len(batch.rows)
            if self._recompute_on_update:
                self._m.recompute_cache(batch)
            self._m.synchronize()
        except Exception as exc:  # surfaced to the caller of update_weights
            update.loop.call_soon_threadsafe(_resolve, update.done, exc)
            return
        finished = time.perf_counter()
        report = WeightUpdateReport(
            policy_version=update.policy_version,
            previous_version=previous,
            tensors=len(update.tensors),
            copy_s=copied - started,
            pause_s=finished - started,
            in_flight=in_flight,
        )
        log.info(
            "policy %d -> %d: %d tensors copied in %.1f ms, %d rows recomputed, decoding paused %.1f ms",
            previous, update.policy_version, report.tensors, report.copy_s * 1e3, in_flight, report.pause_s * 1e3,
        )  # fmt: skip
        update.loop.call_soon_threadsafe(_resolve, update.done, report)

    def _apply_adapter(self, batch: Batch, update: _AdapterUpdate) -> None:
        started = time.perf_counter()
        bank = self._m.bank
        assert bank is not None
        try:
            self._m.forget_prefixes()
            bank.load(update.name, update.weights)
            copied = time.perf_counter()
            previous = self._adapter_versions.get(update.name, 0)
            self._adapter_versions[update.name] = update.policy_version
            rows = [i for i, row in enumerate(batch.rows) if row.params.adapter == update.name]
            serving = len(rows)
            if rows and self._recompute_on_update:
                self._m.recompute_rows(batch, rows)  # only this adapter's rows: the others do not pause for them
            self._m.synchronize()
        except Exception as exc:  # AdapterRefused, surfaced to the caller
            update.loop.call_soon_threadsafe(_resolve, update.done, exc)
            return
        finished = time.perf_counter()
        report = WeightUpdateReport(
            update.policy_version, previous, len(update.weights.modules), copied - started, finished - started, serving
        )
        log.info(
            "adapter %s %d -> %d: %d modules, %d rows on it continued, decoding paused %.1f ms",
            update.name, previous, update.policy_version, report.tensors, serving, report.pause_s * 1e3,
        )  # fmt: skip
        update.loop.call_soon_threadsafe(_resolve, update.done, report)

    def _unload_adapter(self, batch: Batch, unload: _AdapterUnload) -> None:
        # Rows still in the batch count even when aborted: the next decode step names their adapter.
        users = sum(1 for row in batch.rows if row.params.adapter == unload.name)
        users += sum(1 for row in self._backlog if row.params.adapter == unload.name and not row.aborted)
        outcome: BaseException | None = None
        if users:
            outcome = Conflict(
                f"Adapter `{unload.name}` is in use by {users} requests; unload it once they have finished.",
                code="adapter_in_use",
            )
        else:
            try:
                assert self._m.bank is not None
                self._m.bank.unload(unload.name)
                self._adapter_versions.pop(unload.name, None)
                log.info("adapter %s unloaded", unload.name)
            except Exception as exc:  # KeyError: unloaded already
                outcome = exc
        unload.loop.call_soon_threadsafe(_resolve, unload.done, outcome)


def _constrain(rows: list[Row], logits: torch.Tensor) -> tuple[dict[int, str], list[int | None] | None]:
    """Mask what each constrained row's grammar forbids (in place); say which rows fail alone and
    which scripted rows' next tokens stand (the grammar refuses a script as it would a draw; None:
    no row of this step is scripted, as on every step of an engine that is not the scripted one)."""
    faults: dict[int, str] = {}  # row -> why it fails alone
    forced: list[int | None] = [None] * len(rows)  # a scripted row's next token (engines/scripted.py)
    for i, row in enumerate(rows):
        script = row.script
        if script is not None and row.generated < len(script):
            forced[i] = script[row.generated]
        if row.mask is not None:  # constrained: what the grammar does not allow cannot be drawn
            try:
                allowed = row.mask.allowed()
            except Exception as exc:  # llguidance's own refusal
                faults[i] = f"its grammar failed: {exc}"
                continue
            if not allowed.any():
                faults[i] = "its grammar allows no token here"
                continue
            logits[i, torch.from_numpy(~allowed)] = float("-inf")
            token = forced[i]
            if token is not None and not (0 <= token < allowed.shape[0] and allowed[token]):
                # The grammar refuses the script, as it would a model's choice: the model samples on.
                log.info("request %s: its grammar refuses the script at output token %d", row.request_id, row.generated)
                forced[i], row.script = None, None
    return faults, forced if any(token is not None for token in forced) else None


def _deliver(deliveries: list[tuple[Row, EngineStep]]) -> None:
    for request, step in deliveries:
        request.outbox.put_nowait(step)


def _resolve(future: asyncio.Future[Any], outcome: Any) -> None:
    if future.done():
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


def engine_options(name: str, settings: Settings) -> dict[str, Any]:
    """The engine's constructor arguments from a process's settings (see :mod:`.registry`)."""
    from stream_gateway.engines._build import default_name

    return {
        "served_model_name": settings.served_model_name or default_name(settings.model),
        "max_batch_size": settings.max_batch_size,
        "max_model_len": settings.max_model_len,
        "device": settings.device,
        "recompute_on_update": settings.kv_cache_on_update == "recompute",
        "routed_experts": settings.routed_experts,
        "loras": settings.lora_adapters(),
        "max_loras": settings.max_loras,
        "prefix_cache_mb": settings.prefix_cache_mb,
    }


def create_engine(name: str, model: str | Path, **options: Any) -> TransformersEngine:
    """A :class:`TransformersEngine` on ``model`` (see :mod:`.registry`)."""
    return TransformersEngine(model, **options)
