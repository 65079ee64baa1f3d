"""The ``transformers`` engine: a real Hugging Face causal LM, batching concurrent requests.

Why a hand-written batch loop rather than ``model.generate`` or transformers' continuous
batching: every request needs its own temperature, top-p, top-k and seed, the logprobs of exactly
the sampled ids, and the ability to join or leave the batch at any step. ``generate`` fixes the
batch up front; the continuous-batching manager shares one generation config and needs paged
attention kernels. The loop here is small:

* One worker thread owns the model, so forward passes never run on the event loop.
* New requests are prefilled one at a time, then merged into the running batch. The batch's
  KV cache is left-padded to a common length; each row has its own attention mask and
  position ids, exactly as batched ``generate`` does with left padding.
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
import inspect
import logging
import queue
import secrets
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import anyio
import numpy as np
import torch
from pipeline.vision import ProcessedImage, VisionProcessor
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedTokenizerBase
from transformers.cache_utils import DynamicLayer

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
from stream_gateway.engines._sampling import sample_batch
from stream_gateway.engines._weights import check_tensors, read_checkpoint
from stream_gateway.lora import LoraBank, LoraWeights, read_adapter
from stream_gateway.moe import RouterCapture

__all__ = ["TransformersEngine"]

log = logging.getLogger(__name__)

_STOP = object()


@dataclass(eq=False, slots=True)
class _Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    outbox: asyncio.Queue[EngineStep | BaseException]
    generator: torch.Generator
    stop_ids: frozenset[int]
    aborted: bool = False
    generated: int = 0
    # Set by the worker: the token that the next decode step feeds for this row.
    pending_token: int = -1
    length: int = 0  # real (unpadded) tokens in this row's cache
    output_ids: list[int] = field(default_factory=list)  # to rebuild the cache after a weight update
    mask: TokenMask | None = None  # the grammar of a constrained request (built by the worker)
    # Vision-language models: the prompt's images, in order, and their multimodal rotary positions.
    images: tuple[ProcessedImage, ...] = ()
    mrope: torch.Tensor | None = None  # [3, prompt] positions of the prompt (None: text positions)
    rope_delta: int = 0  # a position after the prompt is its index plus this (images take fewer positions)


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


@dataclass(slots=True)
class _Batch:
    """The running batch: rows, a left-padded KV cache and its attention mask."""

    rows: list[_Request] = field(default_factory=list)
    cache: DynamicCache | None = None
    mask: torch.Tensor | None = None  # [rows, cache_len], 1 for real tokens


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
        self._bank: LoraBank | None = None  # LoRA adapters beside the base, applied per row
        self.policy_version = 0
        self.max_model_len = max_model_len or 0
        self.tokenizer: PreTrainedTokenizerBase
        self._model: Any = None
        self._eos_ids: frozenset[int] = frozenset()
        self._inbox: queue.SimpleQueue[_Request | _WeightUpdate | _AdapterUpdate | _AdapterUnload | object] = (
            queue.SimpleQueue()
        )
        self._backlog: deque[_Request] = deque()  # taken from the inbox, waiting for a free row
        self._targets: dict[str, torch.Tensor] = {}  # every state-dict name (tied ones too) -> tensor
        self._last_logits: dict[str, int] = {}
        self._routes: RouterCapture | None = None  # hooks on the routers of a mixture of experts
        self.experts: ExpertShape | None = None
        self.vision: VisionProcessor | None = None  # a vision-language model's image processor
        self._rope_index: Any = None  # its multimodal rotary positions (Qwen2-VL's get_rope_index)
        self._adapter_versions: dict[str, int] = {}  # LoRA adapters (stream_gateway.lora): name -> version
        self.adapters: Mapping[str, int] = self._adapter_versions
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._recoveries = 0
        self._last_fault: str | None = None
        self._prefilling: _Request | None = None
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
        self.tokenizer = AutoTokenizer.from_pretrained(self._model_path)
        model: Any = self._load_model()
        threads = self._num_threads
        if threads is None and self._device.type == "cpu" and getattr(model.config, "hidden_size", 0) < 256:
            # Matrices this small finish faster than intra-op threads wake up: with two threads a
            # 64-wide model decodes ~10x slower than with one (measured on the 2-core CI machine).
            threads = 1
        if threads:
            torch.set_num_threads(threads)
        self._model = model.to(self._device).eval()
        self._targets = dict(self._model.state_dict(keep_vars=True))
        # A prefill needs the logits of its last position only: computing the vocabulary projection
        # for every position cost more than the layers on the tiny model (most HF causal LMs take it).
        if "logits_to_keep" in inspect.signature(self._model.forward).parameters:
            self._last_logits = {"logits_to_keep": 1}
        config = model.config.get_text_config()
        limit = int(getattr(config, "max_position_embeddings", 0) or 0) or 2048
        self.max_model_len = min(self._requested_max_len or limit, limit)
        self._eos_ids = end_of_turn_ids(model, self.tokenizer)
        if self._lora_dirs:
            self._bank = LoraBank(self._model, max_adapters=self._max_loras)
            for name, directory in self._lora_dirs.items():
                try:
                    self._bank.load(name, read_adapter(directory))
                except AdapterRefused as exc:
                    raise EngineUnavailable(f"--lora {name}={directory}: {exc}") from exc
                self._adapter_versions[name] = 0
            log.info("LoRA adapters loaded beside the base: %s", ", ".join(self._lora_dirs))
        # A mixture of experts: every forward pass records the experts it chose (no extra pass).
        try:
            self._routes = RouterCapture.attach(self._model) if self._record_routes else None
        except NotImplementedError as exc:  # experts whose choice stream_gateway.moe cannot read
            log.warning("serving without routed experts: %s", exc)
        if self._routes is not None:
            self.experts = ExpertShape(self._routes.layers, self._routes.top_k, self._routes.num_experts)

    def _load_model(self) -> Any:
        """The causal LM, or a vision-language model with its image processor (docs/images.md)."""
        config = AutoConfig.from_pretrained(self._model_path)
        if getattr(config, "vision_config", None) is None:
            return AutoModelForCausalLM.from_pretrained(self._model_path, dtype=self._dtype)
        from transformers import AutoModelForImageTextToText

        model = AutoModelForImageTextToText.from_pretrained(self._model_path, dtype=self._dtype)
        self._rope_index = getattr(model.model, "get_rope_index", None)
        if self._rope_index is None:
            raise EngineUnavailable(f"{self._model_path}: a vision-language model without multimodal positions")
        self.vision = VisionProcessor.from_model(self._model_path, int(config.image_token_id))
        return model

    # -- public API ------------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        affinity: str | None = None,
        images: Sequence[ProcessedImage] = (),
    ) -> AsyncGenerator[EngineStep, None]:
        """Queue a request and yield its steps as the worker samples them (``images``: a
        vision-language model's, in the order of their placeholders in ``prompt_ids``)."""
        if self._thread is None or not self._thread.is_alive():
            raise EngineUnavailable("the transformers engine is not running") from self._failure
        generator = torch.Generator()
        generator.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))
        stop_ids = params.stop_token_ids if params.ignore_eos else params.stop_token_ids | self._eos_ids
        request = _Request(
            request_id=request_id,
            prompt_ids=list(prompt_ids),
            params=params,
            loop=asyncio.get_running_loop(),
            outbox=asyncio.Queue(),
            generator=generator,
            stop_ids=stop_ids,
            images=tuple(images),
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
        check_tensors(self._targets, tensors)
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
        if self._bank is None:
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
        if self._bank is None or name not in self._adapter_versions:
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
            target = self._targets[name]
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
        batch = _Batch()
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
                if isinstance(item, _Request):
                    waiting.append(item)
                elif isinstance(item, _WeightUpdate | _AdapterUpdate | _AdapterUnload):
                    item.loop.call_soon_threadsafe(_resolve, item.done, exc)
            for row in waiting:
                row.loop.call_soon_threadsafe(row.outbox.put_nowait, exc)
            raise

    def _recover(self, batch: _Batch, exc: Exception) -> _Batch:
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
        if self._routes is not None:
            self._routes.discard()
        return _Batch()

    def _admit(self, batch: _Batch) -> bool:
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
            elif isinstance(item, _Request):
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

    def _prefill(self, batch: _Batch, request: _Request) -> None:
        constraint = request.params.constraint
        if constraint is not None:  # in the worker: building a large grammar's first mask takes a while
            vocab = int(self._model.config.get_text_config().vocab_size)
            request.mask = TokenMask(constraint, grammar_tokenizer(self.tokenizer, vocab, self._eos_ids), vocab)
        if self._routes is not None:
            self._routes.discard()  # a forward pass that failed part-way left some behind
        if self._bank is not None:
            self._bank.set_rows((request.params.adapter,))
        cache = DynamicCache()
        ids = torch.tensor([request.prompt_ids], device=self._device)
        vision: dict[str, Any] = {}
        if self.vision is not None:
            vision = self._vision_inputs([request], ids)
            request.mrope = vision["position_ids"][:, 0, :] if request.images else None
        out = self._model(input_ids=ids, past_key_values=cache, use_cache=True, **vision, **self._last_logits)
        request.length = len(request.prompt_ids)
        routes = [self._routes.take()[0]] if self._routes is not None else None  # [prompt, layers, top_k]
        finished = self._emit([request], out.logits[:, -1, :], [request.params], [request.generator], routes)
        if finished[0]:
            return
        self._merge(batch, request, cache)

    def _merge(self, batch: _Batch, request: _Request, cache: DynamicCache) -> None:
        new_mask = torch.ones((1, request.length), dtype=torch.long, device=self._device)
        if batch.cache is None or batch.mask is None:
            batch.rows, batch.cache, batch.mask = [request], cache, new_mask
            return
        width = max(batch.mask.shape[1], request.length)
        for old, new in zip(_layers(batch.cache), _layers(cache), strict=True):
            (old_keys, old_values), (new_keys, new_values) = _kv(old), _kv(new)
            old.keys = torch.cat([_left_pad(old_keys, width), _left_pad(new_keys, width)], dim=0)
            old.values = torch.cat([_left_pad(old_values, width), _left_pad(new_values, width)], dim=0)
        batch.mask = torch.cat([_left_pad(batch.mask, width), _left_pad(new_mask, width)], dim=0)
        batch.rows.append(request)

    def _decode(self, batch: _Batch) -> None:
        assert batch.cache is not None and batch.mask is not None
        rows = batch.rows
        ids = torch.tensor([[r.pending_token] for r in rows], device=self._device)
        positions = torch.tensor([[r.length + r.rope_delta] for r in rows], device=self._device)
        batch.mask = torch.cat([batch.mask, batch.mask.new_ones((len(rows), 1))], dim=1)
        if self._bank is not None:
            self._bank.set_rows([r.params.adapter for r in rows])
        out = self._model(
            input_ids=ids,
            attention_mask=batch.mask,
            position_ids=positions,
            past_key_values=batch.cache,
            use_cache=True,
        )
        for r in rows:
            r.length += 1
        routes = list(self._routes.take()) if self._routes is not None else None  # rows x [1, layers, top_k]
        logits = out.logits[:, -1, :]
        finished = self._emit(rows, logits, [r.params for r in rows], [r.generator for r in rows], routes)
        keep = [i for i, (r, done) in enumerate(zip(rows, finished, strict=True)) if not (done or r.aborted)]
        if len(keep) == len(rows):
            return
        # Finished rows were already counted out by _emit; aborted ones leave here.
        self._active -= sum(1 for r, done in zip(rows, finished, strict=True) if r.aborted and not done)
        if not keep:
            batch.rows, batch.cache, batch.mask = [], None, None
            return
        index = torch.tensor(keep, device=self._device)
        batch.rows = [rows[i] for i in keep]
        batch.mask = batch.mask[index]
        # Columns that are padding in every remaining row are dead weight for attention.
        trim = int((batch.mask.cumsum(dim=1) == 0).all(dim=0).sum())
        batch.mask = batch.mask[:, trim:]
        for layer in _layers(batch.cache):
            keys, values = _kv(layer)
            layer.keys, layer.values = keys[index, :, trim:, :], values[index, :, trim:, :]

    def _emit(
        self,
        rows: list[_Request],
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
        faults: dict[int, str] = {}  # row -> why it fails alone
        for i, row in enumerate(rows):
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
        # One reduction per step: a row's peak is NaN if any score is, -inf if every score is.
        unusable = ~torch.isfinite(logits.amax(dim=1))
        if bool(unusable.any()):
            for i in unusable.nonzero().flatten().tolist():
                faults.setdefault(i, "the model's scores for it are not finite")
        if faults:  # sampled like the rest (so one row cannot fail the draw), then dropped
            logits[list(faults)] = 0.0
        sampled = sample_batch(logits, params, generators)
        finished: list[bool] = []
        deliveries: list[tuple[_Request, EngineStep]] = []
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
                cached_prompt_tokens=0 if reason is not None else None,  # it prefills every prompt whole
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

    def _fail_row(self, row: _Request, why: str) -> None:
        """End one request with :class:`SequenceFailed`; the batch drops its row at this step."""
        self._active -= 1
        log.warning("request %s fails alone: %s", row.request_id, why)
        failed = SequenceFailed(f"The engine could not go on with this request: {why}")
        row.loop.call_soon_threadsafe(row.outbox.put_nowait, failed)

    def _apply_weights(self, batch: _Batch, update: _WeightUpdate) -> None:
        started = time.perf_counter()
        try:
            with torch.no_grad():
                for name, tensor in update.tensors.items():
                    self._targets[name].data.copy_(tensor)
            self._synchronize()  # on a GPU the copy is queued, not done: time what it costs
            copied = time.perf_counter()
            previous, self.policy_version = self.policy_version, update.policy_version
            in_flight = len(batch.rows)
            if self._recompute_on_update:
                self._recompute_cache(batch)
            self._synchronize()
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

    def _apply_adapter(self, batch: _Batch, update: _AdapterUpdate) -> None:
        started = time.perf_counter()
        assert self._bank is not None
        try:
            self._bank.load(update.name, update.weights)
            copied = time.perf_counter()
            previous = self._adapter_versions.get(update.name, 0)
            self._adapter_versions[update.name] = update.policy_version
            rows = [i for i, row in enumerate(batch.rows) if row.params.adapter == update.name]
            serving = len(rows)
            if rows and self._recompute_on_update:
                self._recompute_rows(batch, rows)  # only this adapter's rows: the others do not pause for them
            self._synchronize()
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

    def _unload_adapter(self, batch: _Batch, unload: _AdapterUnload) -> None:
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
                assert self._bank is not None
                self._bank.unload(unload.name)
                self._adapter_versions.pop(unload.name, None)
                log.info("adapter %s unloaded", unload.name)
            except Exception as exc:  # KeyError: unloaded already
                outcome = exc
        unload.loop.call_soon_threadsafe(_resolve, unload.done, outcome)

    def _synchronize(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)

    def _recompute_cache(self, batch: _Batch) -> None:
        """Rebuild every running row's KV cache with the current weights (prompt + output so far).

        One left-padded forward pass over all rows: the cache it leaves is laid out exactly as
        :meth:`_merge` lays out a batch. The last sampled token of a row is not in its cache yet:
        it is the next step's input.
        """
        if not batch.rows:
            return
        width = max(row.length for row in batch.rows)
        batch.cache, batch.mask = self._prefill_rows(batch.rows, width)

    def _recompute_rows(self, batch: _Batch, indices: list[int]) -> None:
        """Rebuild the KV cache of the rows ``indices`` alone (an adapter's, after its update).

        One forward pass over just those rows, left-padded to the batch's width so that each
        row's cache lands in the columns it already occupies; the other rows' cache is untouched.
        """
        assert batch.cache is not None and batch.mask is not None
        cache, _ = self._prefill_rows([batch.rows[i] for i in indices], batch.mask.shape[1])
        index = torch.tensor(indices, device=self._device)
        for old, new in zip(_layers(batch.cache), _layers(cache), strict=True):
            (old_keys, old_values), (new_keys, new_values) = _kv(old), _kv(new)
            old_keys[index] = new_keys
            old_values[index] = new_values

    def _prefill_rows(self, rows: list[_Request], width: int) -> tuple[DynamicCache, torch.Tensor]:
        """A fresh KV cache of ``rows`` (each its prompt and all but its last sampled token),
        left-padded to ``width`` columns, with its attention mask."""
        ids = torch.zeros((len(rows), width), dtype=torch.long, device=self._device)
        mask = torch.zeros((len(rows), width), dtype=torch.long, device=self._device)
        for i, row in enumerate(rows):
            sequence = row.prompt_ids + row.output_ids[:-1]
            assert len(sequence) == row.length <= width, "a row's cache holds its prompt and all but its last token"
            ids[i, width - len(sequence) :] = torch.tensor(sequence, device=self._device)
            mask[i, width - len(sequence) :] = 1
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        vision: dict[str, Any] = {"position_ids": positions}
        if any(row.images for row in rows):
            vision = self._vision_inputs(rows, ids, positions)
        if self._bank is not None:
            self._bank.set_rows([row.params.adapter for row in rows])
        cache = DynamicCache()
        self._model(
            input_ids=ids,
            attention_mask=mask,
            past_key_values=cache,
            use_cache=True,
            **vision,
            **self._last_logits,
        )
        if self._routes is not None:
            # A position keeps the experts that routed it when it was first run (and sampled the
            # next token): the recomputed cache's routes are not recorded (docs/moe.md).
            self._routes.discard()
        return cache, mask

    def _vision_inputs(
        self, rows: list[_Request], ids: torch.Tensor, text_positions: torch.Tensor | None = None
    ) -> dict[str, Any]:
        """Pixel values, grids and multimodal positions for a forward pass over ``ids``.

        One row (a prefill, ``text_positions`` None): its prompt, positioned by the model's own
        ``get_rope_index``, whose delta the row keeps for every later position. Several (a cache
        recomputed after a weight update; ``ids`` left-padded, ``text_positions`` their 1-D
        positions): each row's prompt positions as its prefill computed them, its outputs after.
        """
        images = [image for row in rows for image in row.images]
        inputs: dict[str, Any] = {}
        if images:
            pixels = np.concatenate([image.pixel_values for image in images])
            inputs["pixel_values"] = torch.from_numpy(pixels).to(device=self._device, dtype=self._dtype)
            inputs["image_grid_thw"] = torch.tensor([image.grid_thw for image in images], device=self._device)
        if text_positions is None:
            (row,) = rows
            if not row.images:
                inputs["position_ids"] = torch.arange(ids.shape[1], device=self._device).view(1, -1)
                return inputs
            assert self.vision is not None
            kinds = (ids == self.vision.token_id).int()
            positions, deltas = self._rope_index(ids, mm_token_type_ids=kinds, image_grid_thw=inputs["image_grid_thw"])
            row.rope_delta = int(deltas.view(-1)[0])
            inputs["position_ids"] = positions
            return inputs
        width = ids.shape[1]
        positions = text_positions.unsqueeze(0).repeat(3, 1, 1)
        for i, row in enumerate(rows):
            if row.mrope is None:
                continue
            prompt = row.mrope.shape[1]
            start = width - row.length
            positions[:, i, start : start + prompt] = row.mrope
            positions[:, i, start + prompt :] += row.rope_delta
        inputs["position_ids"] = positions
        return inputs


def _deliver(deliveries: list[tuple[_Request, EngineStep]]) -> None:
    for request, step in deliveries:
        request.outbox.put_nowait(step)


def _resolve(future: asyncio.Future[Any], outcome: Any) -> None:
    if future.done():
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


def _layers(cache: DynamicCache) -> list[DynamicLayer]:
    """The cache's per-layer KV tensors (full attention only: this engine serves such models)."""
    return cast(list[DynamicLayer], cache.layers)


def _kv(layer: DynamicLayer) -> tuple[torch.Tensor, torch.Tensor]:
    assert layer.keys is not None and layer.values is not None, "prefill fills every layer"
    return layer.keys, layer.values


def _left_pad(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """Left-pad the sequence axis (-2 for KV [B,H,L,D], -1 for masks [B,L]) with zeros."""
    axis = -1 if tensor.dim() == 2 else -2
    missing = width - tensor.shape[axis]
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[axis] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=axis)


def end_of_turn_ids(model: Any, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """The tokens that end a turn: the generation config's, the model config's and the tokenizer's
    end-of-sequence ids (what a grammar of :mod:`stream_gateway.constraints` allows at its end)."""
    eos: set[int] = set()
    config = model.config.get_text_config()  # a vision-language model's end ids are its language model's
    for source in (model.generation_config.eos_token_id, config.eos_token_id, tokenizer.eos_token_id):
        if isinstance(source, int):
            eos.add(source)
        elif source:
            eos.update(int(s) for s in source)
    return frozenset(eos)
