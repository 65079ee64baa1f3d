"""LoRA adapters applied per batch row on a shared base model.

A :class:`LoraBank` holds the adapters loaded beside one base model and adds, in forward hooks on
the targeted ``nn.Linear`` modules, each row's adapter delta to that row's output: one batch of the
transformers engine's continuous batching can decode rows of several adapters and of the base
together. Adapters are read in PEFT's format (:func:`read_adapter`) or from a config and a state
dict (:func:`adapter_from_tensors`, for weights published over NATS); loading a name again replaces
its weights (a new version) between two forward passes.

Written against PEFT 0.21.2, read in ``tuners/lora/layer.py`` (``LoraLayer.update_layer``,
``Linear.forward``, ``Linear._mixed_batch_forward``, ``dispatch_default``), ``tuners/lora/model.py``
(``_create_and_replace``), ``tuners/lora/config.py`` (``LoraConfig``), ``utils/other.py``
(``get_pattern_key``) and ``peft_model.py`` (``save_pretrained``), and against torch 2.13.

Deliberate choices:

* PEFT is not used at run time (its format and math are followed; the tests use it as the
  reference). ``get_peft_model`` / ``load_adapter`` replace the base's modules with wrappers, and its
  mixed-batch path takes ``adapter_names`` per call of ``generate()``; the engine decodes in its own
  loop, needs versions of an adapter swapped in place, and rows that join and leave between steps.
* Hooks, not module swaps: the base model is untouched, and a bank can be dropped (:meth:`LoraBank.detach`).
  A module is hooked the first time any adapter targets it and stays hooked; with every row on the
  base each hook returns at its first test (a Python call per hooked module per forward pass).
* The math is PEFT's ``Linear`` forward: ``out += B(A(x.to(A.dtype))) * scaling`` with
  ``scaling = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``), ``r`` and ``lora_alpha``
  per module from ``rank_pattern`` / ``alpha_pattern`` matched as PEFT's ``get_pattern_key`` does.
  The scaling is applied by the add (``index_add_(..., alpha=scaling)``), one kernel fewer per module.
  A and B are held in the targeted module's dtype, so the delta is computed in the model dtype.
  PEFT by default upcasts the adapters of a float16/bfloat16 base to float32
  (``autocast_adapter_dtype=True``): there the two differ by the delta's rounding; in float32 (and
  against PEFT with ``autocast_adapter_dtype=False``) they agree to float rounding.
* Rows are grouped by adapter once per :meth:`LoraBank.set_rows` (the index tensors are built there,
  not per hook); a hook gathers a group's rows, computes its delta and ``index_add_``s it back. A group
  covering the whole batch (a prefill ``[1, P]``, or all rows on one adapter) skips the gather. Padding
  positions get a delta too: LoRA acts per position, so a padded position's value never reaches a real one.
* Only ``adapter_model.safetensors`` is read, never the pickled ``adapter_model.bin`` (unpickling runs
  code; convert it once with PEFT). What changes the forward beyond plain LoRA is refused
  (:class:`AdapterRefused` ``"unsupported"``): bias other than ``"none"``, ``lora_bias``, DoRA and the
  other LoRA variants, ``modules_to_save``, trainable tokens, ``target_parameters``, embedding adapters,
  ``fan_in_fan_out`` (an adapter made for ``Conv1D`` layers; the bank hooks ``nn.Linear`` only) and the
  initialisations that rewrite the base weights (PiSSA, OLoRA, CorDA, LoftQ, LoRA-GA; convert them to
  plain LoRA with PEFT first). ``lora_dropout`` is inactive at inference and ignored.
* The tensors name the modules: ``target_modules`` (a list or a regex), ``exclude_modules`` and
  ``layers_to_transform`` decided which modules PEFT wrapped, and it saved exactly those.
* A new version is checked whole against the base before it replaces the old one: a refused load
  leaves the bank as it was.

Not thread-safe: :meth:`LoraBank.load`, :meth:`LoraBank.unload` and :meth:`LoraBank.set_rows` are called
from the thread that runs the model's forward passes (the engine's worker), between two of them.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final, NamedTuple

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch.utils.hooks import RemovableHandle

from stream_gateway._errors import AdapterRefused

__all__ = ["AdapterRefused", "LoraBank", "LoraWeights", "adapter_from_tensors", "read_adapter"]


CONFIG_NAME: Final = "adapter_config.json"
WEIGHTS_NAME: Final = "adapter_model.safetensors"
_PICKLED_WEIGHTS_NAME: Final = "adapter_model.bin"
_KEY_PREFIX: Final = "base_model.model."  # PeftModel -> LoraModel -> the base, in saved keys
_KEY = re.compile(r"(?P<module>.+)\.lora_(?P<which>[AB])\.weight")

# Config fields whose truthy value changes the forward beyond plain LoRA (PEFT 0.21.2's LoraConfig).
_UNSUPPORTED_FLAGS: Final = {
    "use_dora": "DoRA (use_dora)",
    "lora_bias": "a bias on lora_B (lora_bias)",
    "modules_to_save": "fully trained modules (modules_to_save)",
    "trainable_token_indices": "trainable tokens (trainable_token_indices)",
    "target_parameters": "LoRA on parameters (target_parameters)",
    "layer_replication": "layer replication (layer_replication)",
    "megatron_config": "Megatron parallel layers (megatron_config)",
    "use_qalora": "QALoRA (use_qalora)",
    "use_bdlora": "the BD-LoRA variant (use_bdlora)",
    "velora_config": "the VeLoRA variant (velora_config)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "monteclora_config": "the MonteCLoRA variant (monteclora_config)",
    "arrow_config": "Arrow routing (arrow_config)",
    "kasa_config": "the KaSA variant (kasa_config)",
    "fan_in_fan_out": "fan_in_fan_out (an adapter for Conv1D layers; only nn.Linear is hooked)",
}
# Initialisations that leave the base weights as they were (the others rewrite them, or are a variant).
_PLAIN_INITS: Final = (True, False, "gaussian", "eva", "orthogonal")


@dataclass(frozen=True, slots=True, eq=False)
class LoraWeights:
    """One adapter version read from disk or from tensors: per target module name (as in
    ``base_model.named_modules()``, e.g. ``"model.layers.0.self_attn.q_proj"``), ``(A [r, in], B [out, r], scaling)``.

    Compared by identity (tensors have no single truth value).
    """

    modules: Mapping[str, tuple[torch.Tensor, torch.Tensor, float]]
    rank: int  # the largest r over the modules
    target_modules: frozenset[str]  # the config's short names, e.g. {"q_proj", "v_proj"}


# -- reading -----------------------------------------------------------------------------------


def read_adapter(directory: str | Path) -> LoraWeights:
    """The adapter PEFT saved in ``directory`` (``adapter_config.json`` and ``adapter_model.safetensors``).

    Raises :class:`AdapterRefused`: ``"unreadable"`` for a missing or malformed file, ``"unsupported"``
    for a pickled ``adapter_model.bin`` alone or a config beyond plain LoRA (see the module docstring).
    """
    path = Path(directory)
    try:
        config = json.loads((path / CONFIG_NAME).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterRefused("unreadable", f"{path / CONFIG_NAME}: {exc}") from exc
    if not isinstance(config, dict):
        raise AdapterRefused("unreadable", f"{path / CONFIG_NAME} holds {type(config).__name__}, not an object")
    weights = path / WEIGHTS_NAME
    if not weights.is_file() and (path / _PICKLED_WEIGHTS_NAME).is_file():
        raise AdapterRefused(
            "unsupported",
            f"{path} holds {_PICKLED_WEIGHTS_NAME} only: pickled weights are not read; "
            f"save the adapter with safe_serialization=True ({WEIGHTS_NAME})",
        )
    try:
        tensors = load_file(weights, device="cpu")
    except (OSError, SafetensorError) as exc:
        raise AdapterRefused("unreadable", f"{weights}: {exc}") from exc
    return adapter_from_tensors(config, tensors)


def adapter_from_tensors(config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> LoraWeights:
    """The adapter of a PEFT ``LoraConfig`` dict and its saved state dict (keys such as
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``; the ``base_model.model.`` prefix
    may be left out). Missing config fields take PEFT's defaults (r 8, lora_alpha 8).

    The tensors are kept as given (:meth:`LoraBank.load` copies them to the model). Raises
    :class:`AdapterRefused` (``"unsupported"`` or ``"unreadable"``) as :func:`read_adapter`.
    """
    _check_supported(config)
    r, alpha = _number(config, "r", 8, integer=True), _number(config, "lora_alpha", 8, integer=False)
    rank_pattern, alpha_pattern = _pattern(config, "rank_pattern", True), _pattern(config, "alpha_pattern", False)
    rslora = bool(config.get("use_rslora", False))
    pairs = _pairs(tensors)
    modules: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
    for name, (a, b) in pairs.items():
        module_r = int(rank_pattern.get(_pattern_key(rank_pattern, name), r))
        module_alpha = float(alpha_pattern.get(_pattern_key(alpha_pattern, name), alpha))
        if a.dim() != 2 or b.dim() != 2 or not (a.is_floating_point() and b.is_floating_point()):
            raise AdapterRefused("unreadable", f"{name}: lora_A and lora_B must be 2-D floating tensors")
        if a.shape[0] != module_r or b.shape[1] != module_r:
            raise AdapterRefused(
                "unreadable",
                f"{name}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not have the config's rank {module_r}",
            )
        scaling = module_alpha / math.sqrt(module_r) if rslora else module_alpha / module_r
        modules[name] = (a.detach(), b.detach(), scaling)
    return LoraWeights(
        modules=MappingProxyType(modules),
        rank=max(a.shape[0] for a, _, _ in modules.values()),
        target_modules=_target_modules(config.get("target_modules"), modules),
    )


def _check_supported(config: Mapping[str, Any]) -> None:
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise AdapterRefused("unsupported", f"peft_type {peft_type!r} is not LORA")
    bias = config.get("bias", "none")
    if bias != "none":
        raise AdapterRefused("unsupported", f"bias {bias!r}: adapters that train the base biases are not applied")
    for field, what in _UNSUPPORTED_FLAGS.items():
        if config.get(field):
            raise AdapterRefused("unsupported", f"{what} is not supported: plain LoRA only")
    init = config.get("init_lora_weights", True)
    if not any(init is plain or (isinstance(plain, str) and init == plain) for plain in _PLAIN_INITS):
        raise AdapterRefused(
            "unsupported",
            f"init_lora_weights {init!r} rewrites the base weights or changes the forward: "
            "convert the adapter to plain LoRA with PEFT (path_initial_model_for_weight_conversion)",
        )


def _number(config: Mapping[str, Any], field: str, default: int, *, integer: bool) -> float:
    value = config.get(field, default)
    valid = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, valid) or value <= 0:
        kind = "int" if integer else "number"
        raise AdapterRefused("unreadable", f"{field} must be a positive {kind}, got {value!r}")
    return value


def _pattern(config: Mapping[str, Any], field: str, integer: bool) -> dict[str, float]:
    value = config.get(field) or {}
    if not isinstance(value, Mapping):
        raise AdapterRefused("unreadable", f"{field} must be an object, got {type(value).__name__}")
    return {str(key): _number(value, key, 1, integer=integer) for key in value}


def _pattern_key(keys: Iterable[str], name: str) -> str:
    """PEFT's ``get_pattern_key``: the first key the module name ends with (as a dotted suffix, a regex)."""
    for key in keys:
        if re.match(rf"(.*\.)?({key})$", name):
            return key
    return name


def _pairs(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{module name: (lora_A, lora_B)}``; anything else in the state dict is refused."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.fullmatch(key.removeprefix(_KEY_PREFIX))
        if match is None:
            raise AdapterRefused("unsupported", f"{key!r} is not a lora_A/lora_B weight of a Linear module")
        halves.setdefault(match["module"], {})[match["which"]] = tensor
    if not halves:
        raise AdapterRefused("unreadable", "the adapter holds no LoRA weights")
    incomplete = sorted(name for name, pair in halves.items() if len(pair) != 2)
    if incomplete:
        raise AdapterRefused("unreadable", f"lora_A or lora_B missing for {incomplete[:3]}")
    return {name: (pair["A"], pair["B"]) for name, pair in sorted(halves.items())}


def _target_modules(declared: Any, modules: Mapping[str, Any]) -> frozenset[str]:
    """The config's list of short names; for a regex (or none), the short names of the modules present."""
    if isinstance(declared, list | tuple | set | frozenset) and all(isinstance(n, str) for n in declared):
        return frozenset(declared)
    return frozenset(name.rsplit(".", 1)[-1] for name in modules)


# -- the bank ----------------------------------------------------------------------------------


class _Delta(NamedTuple):
    """One adapter on one module, on the module's device and in its dtype."""

    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scaling: float


@dataclass(frozen=True, slots=True)
class _Group:
    """The rows of one adapter in the current batch."""

    adapter: str
    index: Mapping[torch.device, torch.Tensor] | None  # its rows, on each device a hooked module is on; None: all


def _lora(x: torch.Tensor, delta: _Delta, dtype: torch.dtype) -> torch.Tensor:
    """PEFT's ``lora_B(lora_A(x))`` (``x`` cast to the adapter's dtype first) in ``dtype``, before scaling."""
    return F.linear(F.linear(x.to(delta.a.dtype), delta.a), delta.b).to(dtype)


class LoraBank:
    """The adapters loaded beside a base model, applied per row by forward hooks on the targeted Linear modules.

    ::

        bank = LoraBank(model)
        bank.load("support-v1", read_adapter(path))
        with bank.rows(["support-v1", None, "support-v1"]):
            logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits

    Not thread-safe: call it from the thread that runs the model (see the module docstring).
    """

    def __init__(self, model: torch.nn.Module, *, max_adapters: int = 8) -> None:
        """A bank for ``model`` (nothing is hooked until an adapter is loaded)."""
        if max_adapters < 1:
            raise ValueError(f"max_adapters must be positive, got {max_adapters}")
        self._modules = dict(model.named_modules())
        self._max_adapters = max_adapters
        self._adapters: dict[str, frozenset[str]] = {}  # adapter -> the modules it targets
        self._deltas: dict[str, dict[str, _Delta]] = {}  # module -> adapter -> delta (read by the module's hook)
        self._handles: dict[str, RemovableHandle] = {}
        self._devices: set[torch.device] = set()  # of the hooked modules
        self._rows: tuple[str | None, ...] = ()  # () and all-None: every row on the base
        self._groups: tuple[_Group, ...] = ()

    def load(self, name: str, weights: LoraWeights) -> None:
        """Add adapter ``name`` or replace its weights (a new version), for the forward passes that follow.

        Checked against the base first: every module exists and is an ``nn.Linear`` (else
        :class:`AdapterRefused` ``"target_mismatch"``), A is ``[r, in_features]`` and B ``[out_features, r]``
        (else ``"shape_mismatch"``); a new name beyond ``max_adapters`` is refused (``"too_many"``). A refused
        load changes nothing. The tensors are copied to each module's device and dtype. A module is hooked
        the first time any adapter targets it.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"an adapter name must be a non-empty string, got {name!r}")
        staged = {module: self._stage(name, module, *entry) for module, entry in weights.modules.items()}
        if name not in self._adapters and len(self._adapters) >= self._max_adapters:
            raise AdapterRefused(
                "too_many", f"cannot load adapter {name!r}: {len(self._adapters)} of {self._max_adapters} loaded"
            )
        for deltas in self._deltas.values():
            deltas.pop(name, None)
        devices = len(self._devices)
        for module_name, delta in staged.items():
            if module_name not in self._handles:
                self._deltas[module_name] = {}
                module = self._modules[module_name]
                self._handles[module_name] = module.register_forward_hook(self._hook(self._deltas[module_name]))
                self._devices.add(delta.a.device)
            self._deltas[module_name][name] = delta
        self._adapters[name] = frozenset(staged)
        if len(self._devices) != devices:
            self._regroup()  # the row indices are needed on the new device too

    def _stage(self, name: str, module_name: str, a: torch.Tensor, b: torch.Tensor, scaling: float) -> _Delta:
        module = self._modules.get(module_name)
        if module is None:
            raise AdapterRefused("target_mismatch", f"adapter {name!r} targets {module_name!r}, which the base lacks")
        if not isinstance(module, torch.nn.Linear):
            raise AdapterRefused(
                "target_mismatch", f"adapter {name!r} targets {module_name!r}, a {type(module).__name__}, not a Linear"
            )
        weight = module.weight
        if not weight.is_floating_point():
            raise AdapterRefused(
                "target_mismatch", f"adapter {name!r} targets {module_name!r}, whose weights are {weight.dtype}"
            )
        if not (
            a.dim() == 2
            and b.dim() == 2
            and a.shape[0] == b.shape[1]
            and a.shape[1] == module.in_features
            and b.shape[0] == module.out_features
        ):
            raise AdapterRefused(
                "shape_mismatch",
                f"adapter {name!r} at {module_name!r}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not fit "
                f"a Linear({module.in_features}, {module.out_features}) (A [r, in], B [out, r])",
            )
        return _Delta(
            a.detach().to(weight.device, weight.dtype, copy=True),
            b.detach().to(weight.device, weight.dtype, copy=True),
            float(scaling),
        )

    def unload(self, name: str) -> None:
        """Remove adapter ``name`` (KeyError if it is not loaded); rows set on it run on the base until
        the next :meth:`set_rows`. Its modules stay hooked."""
        if name not in self._adapters:
            raise KeyError(f"adapter {name!r} is not loaded")
        for deltas in self._deltas.values():
            deltas.pop(name, None)
        del self._adapters[name]
        if name in self._rows:
            self._rows = tuple(None if adapter == name else adapter for adapter in self._rows)
            self._regroup()

    def names(self) -> list[str]:
        """The loaded adapters, sorted."""
        return sorted(self._adapters)

    def set_rows(self, adapters: Sequence[str | None]) -> None:
        """The adapter of each batch row for the next forward passes (None: the base).

        Call before a forward: rows map to dim 0 of every targeted module's input (``[batch, seq,
        features]``), and a forward with rows on an adapter whose batch is not ``len(adapters)`` raises
        ValueError. KeyError for a name not loaded. Setting the rows they already are costs a tuple compare.
        """
        rows = tuple(adapters)
        if rows == self._rows:
            return
        unknown = sorted({adapter for adapter in rows if adapter is not None and adapter not in self._adapters})
        if unknown:
            raise KeyError(f"adapters not loaded: {unknown}")
        self._rows = rows
        self._regroup()

    @contextmanager
    def rows(self, adapters: Sequence[str | None]) -> Iterator[None]:
        """:meth:`set_rows` for the block, then every row back on the base."""
        self.set_rows(adapters)
        try:
            yield
        finally:
            self.set_rows(())

    def detach(self) -> None:
        """Remove every hook and adapter: the model is as it was before the bank."""
        for handle in self._handles.values():
            handle.remove()
        self._handles.clear()
        self._deltas.clear()
        self._adapters.clear()
        self._devices.clear()
        self._rows, self._groups = (), ()

    def _regroup(self) -> None:
        by_adapter: dict[str, list[int]] = {}
        for row, adapter in enumerate(self._rows):
            if adapter is not None:
                by_adapter.setdefault(adapter, []).append(row)
        self._groups = tuple(
            _Group(
                adapter,
                None
                if len(rows) == len(self._rows)
                else MappingProxyType({device: torch.tensor(rows, device=device) for device in self._devices}),
            )
            for adapter, rows in by_adapter.items()
        )

    def _hook(self, deltas: Mapping[str, _Delta]) -> Callable[[torch.nn.Module, tuple[Any, ...], Any], None]:
        """The forward hook of one module; ``deltas`` (its adapters) is updated in place by load/unload."""

        def add_deltas(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
            groups = self._groups
            if not groups:  # every row on the base: the common case, kept to one test
                return
            x = args[0]
            if x.shape[0] != len(self._rows):
                raise ValueError(f"a forward over {x.shape[0]} rows while set_rows named {len(self._rows)}")
            for group in groups:
                delta = deltas.get(group.adapter)
                if delta is None:  # this adapter does not target this module
                    continue
                # The scaling rides on the add (alpha=): one kernel fewer per module than PEFT's `* scaling`.
                if group.index is None:
                    output.add_(_lora(x, delta, output.dtype), alpha=delta.scaling)
                else:
                    index = group.index[output.device]
                    rows = _lora(x.index_select(0, index), delta, output.dtype)
                    output.index_add_(0, index, rows, alpha=delta.scaling)

        return add_deltas
