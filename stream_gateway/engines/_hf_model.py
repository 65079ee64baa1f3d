"""The ``transformers`` engine's model: loaded once, and every forward pass over its batch.

:class:`HfModel` owns the Hugging Face model and what a forward pass needs beside it (device,
dtype, LoRA bank, router hooks, image processor and multimodal positions), and the running
:class:`Batch`'s KV cache: a row's prefill, a row merged into the batch, one decode step for every
row, rows dropped, and the cache rebuilt under new weights. It decides nothing: which rows run,
what they sample and when weights change are the engine's (:mod:`.transformers`), which calls in
here from its one worker thread.

The batch's KV cache is left-padded to a common length; each row has its own attention mask and
position ids, exactly as batched ``generate`` does with left padding.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch
from pipeline.vision import ProcessedImage, VisionProcessor
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedTokenizerBase
from transformers.cache_utils import DynamicLayer

from stream_gateway._errors import AdapterRefused, EngineUnavailable
from stream_gateway.constraints import TokenMask, eos_ids
from stream_gateway.engines._base import EngineStep, ExpertShape, SamplingParams
from stream_gateway.engines._prefix_cache import PrefixCache
from stream_gateway.lora import LoraBank, read_adapter
from stream_gateway.moe import RouterCapture

__all__ = ["Batch", "HfModel", "Row", "end_of_turn_ids"]

log = logging.getLogger(__name__)


@dataclass(eq=False, slots=True)
class Row:
    """One request in the batch: what it asked for, where its answer goes, and its cache's state."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    outbox: asyncio.Queue[EngineStep | BaseException]
    generator: torch.Generator
    stop_ids: frozenset[int]
    aborted: bool = False
    generated: int = 0
    # The last sampled token: fed to the next decode step (not yet in the KV cache).
    pending_token: int = -1
    length: int = 0  # real (unpadded) tokens in this row's cache
    output_ids: list[int] = field(default_factory=list)  # to rebuild the cache after a weight update
    mask: TokenMask | None = None  # the grammar of a constrained request (built by the worker)
    # A vision-language prompt: its images, processed (docs/images.md).
    images: tuple[ProcessedImage, ...] = ()
    mrope: torch.Tensor | None = None  # [3, prompt] positions of the prompt (None: text positions)
    rope_delta: int = 0  # a position after the prompt is its index plus this (images take fewer positions)
    # The scripted engine's answer (engines/scripted.py): output token i is script[i] while the
    # grammar, if any, allows it; then the model samples. None: the model samples every token.
    script: Sequence[int] | None = None
    cached: int = 0  # prompt tokens whose keys and values the prefix cache lent (engines/_prefix_cache.py)


@dataclass(slots=True)
class Batch:
    """The running batch: rows, a left-padded KV cache and its attention mask."""

    rows: list[Row] = field(default_factory=list)
    cache: DynamicCache | None = None
    mask: torch.Tensor | None = None  # [rows, cache_len], 1 for real tokens


@dataclass(eq=False, slots=True)
class HfModel:
    """A loaded model and the forward passes over a batch (see the module docstring)."""

    model: Any
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    eos_ids: frozenset[int]
    targets: dict[str, torch.Tensor]  # every state-dict name (tied ones too) -> tensor
    last_logits: dict[str, int]  # {"logits_to_keep": 1} where the model takes it
    bank: LoraBank | None = None  # LoRA adapters beside the base, applied per row
    routes: RouterCapture | None = None  # hooks on the routers of a mixture of experts
    vision: VisionProcessor | None = None  # a vision-language model's image processor
    rope_index: Any = None  # its multimodal rotary positions (Qwen2-VL's get_rope_index)
    # Recent prompts' keys and values (None: off, or a model whose prompts it cannot lend: images
    # position by the whole prompt, and a mixture of experts records the prompt's routes).
    prefixes: PrefixCache | None = None

    @classmethod
    def load(
        cls,
        path: str,
        *,
        device: torch.device,
        dtype: torch.dtype,
        num_threads: int | None,
        max_model_len: int | None,
        loras: Mapping[str, str],
        max_loras: int,
        routed_experts: bool,
        prefix_cache_bytes: int = 0,
    ) -> HfModel:
        """Load the tokenizer and the model (a causal LM, or a vision-language model with its image
        processor), its adapters and its router hooks. Blocking: run it off the event loop."""
        tokenizer = AutoTokenizer.from_pretrained(path)
        config = AutoConfig.from_pretrained(path)
        vision: VisionProcessor | None = None
        rope_index: Any = None
        if getattr(config, "vision_config", None) is None:
            loaded: Any = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        else:
            from transformers import AutoModelForImageTextToText

            loaded = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype)
            rope_index = getattr(loaded.model, "get_rope_index", None)
            if rope_index is None:
                raise EngineUnavailable(f"{path}: a vision-language model without multimodal positions")
            vision = VisionProcessor.from_model(path, int(config.image_token_id))
        threads = num_threads
        if threads is None and device.type == "cpu" and getattr(loaded.config, "hidden_size", 0) < 256:
            # Matrices this small finish faster than intra-op threads wake up: with two threads a
            # 64-wide model decodes ~10x slower than with one (measured on the 2-core CI machine).
            threads = 1
        if threads:
            torch.set_num_threads(threads)
        model = loaded.to(device).eval()
        # A prefill needs the logits of its last position only: computing the vocabulary projection
        # for every position cost more than the layers on the tiny model (most HF causal LMs take it).
        last_logits = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
        text = model.config.get_text_config()
        limit = int(getattr(text, "max_position_embeddings", 0) or 0) or 2048
        bank = None
        if loras:
            bank = LoraBank(model, max_adapters=max_loras)
            for name, directory in loras.items():
                try:
                    bank.load(name, read_adapter(directory))
                except AdapterRefused as exc:
                    raise EngineUnavailable(f"--lora {name}={directory}: {exc}") from exc
            log.info("LoRA adapters loaded beside the base: %s", ", ".join(loras))
        # A mixture of experts: every forward pass records the experts it chose (no extra pass).
        routes = None
        try:
            routes = RouterCapture.attach(model) if routed_experts else None
        except NotImplementedError as exc:  # experts whose choice stream_gateway.moe cannot read
            log.warning("serving without routed experts: %s", exc)
        return cls(
            model=model,
            tokenizer=tokenizer,
            device=device,
            dtype=dtype,
            max_model_len=min(max_model_len or limit, limit),
            eos_ids=end_of_turn_ids(model, tokenizer),
            targets=dict(model.state_dict(keep_vars=True)),
            last_logits=last_logits,
            bank=bank,
            routes=routes,
            vision=vision,
            rope_index=rope_index,
            prefixes=PrefixCache(prefix_cache_bytes)
            if prefix_cache_bytes and vision is None and routes is None
            else None,
        )

    @property
    def experts(self) -> ExpertShape | None:
        routes = self.routes
        return None if routes is None else ExpertShape(routes.layers, routes.top_k, routes.num_experts)

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.get_text_config().vocab_size)

    # -- the batch's passes ----------------------------------------------------------------

    def prefill(self, row: Row) -> tuple[torch.Tensor, DynamicCache, list[np.ndarray] | None]:
        """Run ``row``'s prompt alone, after whatever prefix of it the prefix cache lends: the last
        position's logits, the prompt's cache, and its routes (``[prompt, layers, top_k]``, a
        mixture of experts)."""
        if self.routes is not None:
            self.routes.discard()  # a forward pass that failed part-way left some behind
        if self.bank is not None:
            self.bank.set_rows((row.params.adapter,))
        prefixes, prompt, lent, cache = self.prefixes, None, 0, None
        if prefixes is not None:
            prompt = np.asarray(row.prompt_ids, dtype=np.int64)  # once, for the lending and the keeping
            lent, cache = prefixes.lend(prompt, row.params.adapter)
        if cache is None:
            cache = DynamicCache()
        ids = torch.tensor([row.prompt_ids[lent:]], device=self.device)
        vision: dict[str, Any] = {}
        if self.vision is not None:
            vision = self._vision_inputs([row], ids)
            row.mrope = vision["position_ids"][:, 0, :] if row.images else None
        out = self.model(input_ids=ids, past_key_values=cache, use_cache=True, **vision, **self.last_logits)
        row.length, row.cached = len(row.prompt_ids), lent
        if prefixes is not None and prompt is not None:
            prefixes.keep(prompt, cache, row.params.adapter)
        routes = [self.routes.take()[0]] if self.routes is not None else None
        return out.logits[:, -1, :], cache, routes

    def merge(self, batch: Batch, row: Row, cache: DynamicCache) -> None:
        """Add a prefilled row to the batch, left-padding whichever cache is shorter."""
        new_mask = torch.ones((1, row.length), dtype=torch.long, device=self.device)
        if batch.cache is None or batch.mask is None:
            batch.rows, batch.cache, batch.mask = [row], cache, new_mask
            return
        width = max(batch.mask.shape[1], row.length)
        for old, new in zip(_layers(batch.cache), _layers(cache), strict=True):
            (old_keys, old_values), (new_keys, new_values) = _kv(old), _kv(new)
            old.keys = torch.cat([_left_pad(old_keys, width), _left_pad(new_keys, width)], dim=0)
            old.values = torch.cat([_left_pad(old_values, width), _left_pad(new_values, width)], dim=0)
        batch.mask = torch.cat([_left_pad(batch.mask, width), _left_pad(new_mask, width)], dim=0)
        batch.rows.append(row)

    def decode(self, batch: Batch) -> tuple[torch.Tensor, list[np.ndarray] | None]:
        """One step for every row (its pending token in): the logits, and each row's routes
        (``[1, layers, top_k]``, a mixture of experts)."""
        assert batch.cache is not None and batch.mask is not None
        rows = batch.rows
        ids = torch.tensor([[r.pending_token] for r in rows], device=self.device)
        positions = torch.tensor([[r.length + r.rope_delta] for r in rows], device=self.device)
        batch.mask = torch.cat([batch.mask, batch.mask.new_ones((len(rows), 1))], dim=1)
        if self.bank is not None:
            self.bank.set_rows([r.params.adapter for r in rows])
        out = self.model(
            input_ids=ids,
            attention_mask=batch.mask,
            position_ids=positions,
            past_key_values=batch.cache,
            use_cache=True,
        )
        for r in rows:
            r.length += 1
        routes = list(self.routes.take()) if self.routes is not None else None
        return out.logits[:, -1, :], routes

    def keep_rows(self, batch: Batch, keep: list[int]) -> None:
        """Keep only the rows ``keep`` (indices), and trim the padding no remaining row needs."""
        if not keep:
            batch.rows, batch.cache, batch.mask = [], None, None
            return
        assert batch.cache is not None and batch.mask is not None
        index = torch.tensor(keep, device=self.device)
        batch.rows = [batch.rows[i] for i in keep]
        batch.mask = batch.mask[index]
        # Columns that are padding in every remaining row are dead weight for attention.
        trim = int((batch.mask.cumsum(dim=1) == 0).all(dim=0).sum())
        batch.mask = batch.mask[:, trim:]
        for layer in _layers(batch.cache):
            keys, values = _kv(layer)
            layer.keys, layer.values = keys[index, :, trim:, :], values[index, :, trim:, :]

    def discard_routes(self) -> None:
        """Forget routes a failed forward pass left behind."""
        if self.routes is not None:
            self.routes.discard()

    # -- new weights -----------------------------------------------------------------------

    def copy_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy checked tensors into the parameters (done, not queued, when this returns); the prefix
        cache is emptied, its keys being the old weights'."""
        self.forget_prefixes()
        with torch.no_grad():
            for name, tensor in tensors.items():
                self.targets[name].data.copy_(tensor)
        self.synchronize()

    def forget_prefixes(self) -> None:
        """Empty the prefix cache (weights changed: what it kept is not theirs)."""
        if self.prefixes is not None:
            self.prefixes.clear()

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def recompute_cache(self, batch: Batch) -> None:
        """Rebuild every running row's KV cache with the current weights (prompt + output so far).

        One left-padded forward pass over all rows: the cache it leaves is laid out exactly as
        :meth:`merge` lays out a batch. The last sampled token of a row is not in its cache yet:
        it is the next step's input.
        """
        if not batch.rows:
            return
        width = max(row.length for row in batch.rows)
        batch.cache, batch.mask = self._prefill_rows(batch.rows, width)

    def recompute_rows(self, batch: Batch, indices: list[int]) -> None:
        """Rebuild the KV cache of the rows ``indices`` alone (an adapter's, after its update).

        One forward pass over just those rows, left-padded to the batch's width so that each
        row's cache lands in the columns it already occupies; the other rows' cache is untouched.
        """
        assert batch.cache is not None and batch.mask is not None
        cache, _ = self._prefill_rows([batch.rows[i] for i in indices], batch.mask.shape[1])
        index = torch.tensor(indices, device=self.device)
        for old, new in zip(_layers(batch.cache), _layers(cache), strict=True):
            (old_keys, old_values), (new_keys, new_values) = _kv(old), _kv(new)
            old_keys[index] = new_keys
            old_values[index] = new_values

    def _prefill_rows(self, rows: list[Row], width: int) -> tuple[DynamicCache, torch.Tensor]:
        """A fresh KV cache of ``rows`` (each its prompt and all but its last sampled token),
        left-padded to ``width`` columns, with its attention mask."""
        ids = torch.zeros((len(rows), width), dtype=torch.long, device=self.device)
        mask = torch.zeros((len(rows), width), dtype=torch.long, device=self.device)
        for i, row in enumerate(rows):
            sequence = row.prompt_ids + row.output_ids[:-1]
            assert len(sequence) == row.length <= width, "a row's cache holds its prompt and all but its last token"
            ids[i, width - len(sequence) :] = torch.tensor(sequence, device=self.device)
            mask[i, width - len(sequence) :] = 1
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        vision: dict[str, Any] = {"position_ids": positions}
        if any(row.images for row in rows):
            vision = self._vision_inputs(rows, ids, positions)
        if self.bank is not None:
            self.bank.set_rows([row.params.adapter for row in rows])
        cache = DynamicCache()
        self.model(
            input_ids=ids,
            attention_mask=mask,
            past_key_values=cache,
            use_cache=True,
            **vision,
            **self.last_logits,
        )
        # A position keeps the experts that routed it when it was first run (and sampled the next
        # token): the recomputed cache's routes are not recorded (docs/moe.md).
        self.discard_routes()
        return cache, mask

    def _vision_inputs(
        self, rows: list[Row], ids: torch.Tensor, text_positions: torch.Tensor | None = None
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
            inputs["pixel_values"] = torch.from_numpy(pixels).to(device=self.device, dtype=self.dtype)
            inputs["image_grid_thw"] = torch.tensor([image.grid_thw for image in images], device=self.device)
        if text_positions is None:
            (row,) = rows
            if not row.images:
                inputs["position_ids"] = torch.arange(ids.shape[1], device=self.device).view(1, -1)
                return inputs
            assert self.vision is not None
            kinds = (ids == self.vision.token_id).int()
            positions, deltas = self.rope_index(ids, mm_token_type_ids=kinds, image_grid_thw=inputs["image_grid_thw"])
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
    config = model.config.get_text_config()  # a vision-language model's end ids are its language model's
    return eos_ids(model.generation_config.eos_token_id, config.eos_token_id, tokenizer.eos_token_id)
