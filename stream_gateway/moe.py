"""Routed experts of a mixture-of-experts model: capture per position, a wire form, and replay.

Rollout Routing Replay (R3): the gateway records, for every position a model runs over, the
top-k expert ids each MoE layer's router chose, in the router's order (:class:`RouterCapture`);
the record travels as base64 (:func:`encode_routes`); a trainer later forces exactly those
experts (:func:`replay_routes`), so that the policy it trains routes as the policy that sampled.

Written against transformers 5.10.4, read in ``models/qwen3_moe/modeling_qwen3_moe.py``
(``Qwen3MoeTopKRouter``, ``Qwen3MoeSparseMoeBlock``, ``Qwen3MoePreTrainedModel._can_record_outputs``)
and ``utils/output_capturing.py`` (``OutputRecorder``).

Deliberate choices:

* Routers are found as transformers finds them for ``output_router_logits``: the classes named by
  ``_can_record_outputs["router_logits"]`` of the model's classes, in ``model.modules()`` order
  (layer order). A model with experts but without that entry (DeepSeek-V3, GLM-4-MoE) raises
  :class:`NotImplementedError` rather than passing for dense: a record without its routes would
  train without replay, silently.
* The ids are the router's own output, never a top-k of its logits: in several models the logits
  do not determine the choice (DeepSeek-V3 and GLM-4.5V add a selection bias and choose within
  groups; Llama 4's and Ernie-4.5-VL's recorders name the whole block). A router that returns no
  ids raises :class:`NotImplementedError`, naming its class.
* Each router class is probed once (``attach``, ``replay_routes``' entry): its ``forward`` on a few
  seeded rows, hooks bypassed, tells which output holds the ids (Ernie 4.5 returns them second, not
  third) and, for replay, how its weights follow from its logits, bit for bit: the softmax over all
  experts at the chosen ones, renormalised over the top-k or not, cast to the logits' dtype (Qwen)
  or kept float32 (Mixtral). A router whose weights follow neither rule (gpt-oss: a softmax over
  the chosen logits; DeepSeek-V4: scaled) cannot be replayed and says so.
* A router sees its input flattened to ``[batch * seq, hidden]``; a forward pre-hook on the model
  reads ``[batch, seq]`` from its ``input_ids`` (or ``inputs_embeds``), so routes are positions as
  that forward saw them, padding included. Forward passes of a submodule called directly (not the
  model attached to) record ids without a shape: ``take`` refuses them.
* The capture hook keeps the ids tensor where it is (no device sync per layer); ``take`` stacks,
  converts and copies to the host once.
* torch is imported inside functions: the data path (:func:`encode_routes`, :func:`decode_routes`)
  runs in processes that never load a model.

Not thread-safe: a capture belongs to one model, driven by one thread (the engine's worker).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from pipeline.routes import decode_routes, encode_routes

if TYPE_CHECKING:
    import torch
    from torch.utils.hooks import RemovableHandle

__all__ = ["RouterCapture", "decode_routes", "encode_routes", "replay_routes", "route_dtype"]

_PROBE_ROWS = 5  # rows of a router probe: a count no top-k or expert count is likely to share
_EXPERT_COUNT_NAMES = ("num_experts", "n_routed_experts", "num_local_experts")


# uint16 is little-endian on the wire, whatever the host.
def route_dtype(num_experts: int) -> np.dtype[Any]:
    """The smallest unsigned dtype holding an expert id: uint8 up to 256 experts, uint16 up to 65,536."""
    if num_experts < 1:
        raise ValueError(f"num_experts must be positive, got {num_experts}")
    if num_experts <= 256:
        return np.dtype(np.uint8)
    if num_experts <= 65536:
        return np.dtype(np.uint16)
    raise ValueError(f"{num_experts} experts do not fit a uint16 expert id")


# -- router discovery --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Weighting:
    """How a router's weights follow from its logits and chosen ids (see :func:`_weights`)."""

    renormalise: bool  # over the top-k, as ``norm_topk_prob``
    cast: bool  # to the logits' dtype; else kept float32


@dataclass(frozen=True, slots=True)
class _Layout:
    """Where a router class's output holds what, found by a probe."""

    router: str  # the class's name, for errors
    top_k: int  # columns of its ids
    indices_at: int
    logits_at: int | None  # None: the recorder's output is not [rows, experts] logits
    scores_at: int | None  # None: no float [rows, top_k] output
    weighting: _Weighting | None  # None: weights that no rule reproduces (replay refuses)


@dataclass(frozen=True, slots=True)
class _Routers:
    """A model's routers in layer order, with their common top-k and expert count."""

    modules: tuple[torch.nn.Module, ...]
    layouts: tuple[_Layout, ...]  # one per module (shared by modules of one class)
    top_k: int
    num_experts: int


def _text_config(model: Any) -> Any:
    config = getattr(model, "config", None)
    get_text_config = getattr(config, "get_text_config", None)
    return get_text_config() if callable(get_text_config) else config


def _positive_int(owners: tuple[Any, ...], names: tuple[str, ...]) -> int | None:
    for owner in owners:
        for name in names:
            value = getattr(owner, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _router_specs(model: torch.nn.Module) -> list[tuple[type[Any], int, str | None]] | None:
    """``(class, logits index, layer name)`` of every ``router_logits`` recorder; None: none declared."""
    from transformers.utils.output_capturing import OutputRecorder

    specs: list[tuple[type[Any], int, str | None]] = []
    declared = False
    for module in model.modules():
        recordable = getattr(type(module), "_can_record_outputs", None)
        if not isinstance(recordable, Mapping) or "router_logits" not in recordable:
            continue
        declared = True
        entries = recordable["router_logits"]
        for entry in entries if isinstance(entries, list) else [entries]:
            if isinstance(entry, OutputRecorder) and entry.target_class is not None:
                specs.append((entry.target_class, entry.index, entry.layer_name))
            elif isinstance(entry, type):  # a bare class: transformers' default index for it is 1
                specs.append((entry, 1, None))
            # A class-name suffix alone (multimodal backbones) is not matched here.
    return specs if declared else None


def _probe(router: torch.nn.Module, hidden_size: int) -> tuple[Any, ...]:
    """The router's ``forward`` on seeded rows, its hooks bypassed (and the global RNG untouched)."""
    import torch

    param = next(router.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    dtype = param.dtype if param is not None and param.is_floating_point() else torch.float32
    generator = torch.Generator(device=device).manual_seed(0)
    rows = torch.randn(_PROBE_ROWS, hidden_size, generator=generator, device=device, dtype=dtype)
    try:
        with torch.no_grad():
            output = router.forward(rows)
    except Exception as exc:  # a router that takes more than the hidden states
        raise NotImplementedError(f"{type(router).__qualname__} cannot be probed with hidden states alone") from exc
    return tuple(output) if isinstance(output, tuple | list) else (output,)


def _weights(logits: torch.Tensor, indices: torch.Tensor, weighting: _Weighting) -> torch.Tensor:
    """Routing weights at ``indices``: the softmax over all experts there, as the router computes them."""
    weights = logits.float().softmax(dim=-1).gather(-1, indices)
    if weighting.renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype) if weighting.cast else weights


def _layout(router: torch.nn.Module, outputs: tuple[Any, ...], logits_at: int) -> _Layout:
    import torch

    name = type(router).__qualname__

    def at(dim1: int | None, floating: bool) -> list[int]:
        return [
            i
            for i, t in enumerate(outputs)
            if isinstance(t, torch.Tensor)
            and t.dim() == 2
            and t.shape[0] == _PROBE_ROWS
            and (dim1 is None or t.shape[1] == dim1)
            and t.is_floating_point() == floating
        ]

    ids = at(None, floating=False)
    if len(ids) != 1:
        raise NotImplementedError(
            f"{name} returns no expert ids (one integer [tokens, top_k] output) to record; "
            "a top-k of its logits need not be what the model chose"
        )
    indices = outputs[ids[0]]
    scores = [i for i in at(indices.shape[1], floating=True) if i != logits_at]
    logits = outputs[logits_at] if logits_at < len(outputs) else None
    if not (isinstance(logits, torch.Tensor) and logits.is_floating_point() and logits.dim() == 2):
        return _Layout(name, indices.shape[1], ids[0], None, None, None)
    weighting = None
    if len(scores) == 1:
        actual = outputs[scores[0]]
        for candidate in (_Weighting(r, c) for r in (True, False) for c in (True, False)):
            expected = _weights(logits, indices, candidate)
            if expected.dtype == actual.dtype and torch.equal(expected, actual):
                weighting = candidate
                break
    return _Layout(name, indices.shape[1], ids[0], logits_at, scores[0] if len(scores) == 1 else None, weighting)


def _discover(model: torch.nn.Module) -> _Routers | None:
    """The routers of ``model``, probed; None for a model without experts."""
    config = _text_config(model)
    specs = _router_specs(model)
    if specs is None:
        if _positive_int((config,), _EXPERT_COUNT_NAMES):
            raise NotImplementedError(
                f"{type(model).__name__} has experts but declares no router_logits recorder to find its routers by"
            )
        return None
    found = [
        (module, logits_at)
        for name, module in model.named_modules()
        for cls, logits_at, layer_name in specs
        if isinstance(module, cls) and (layer_name is None or layer_name in name)
    ]
    modules: list[torch.nn.Module] = []
    layouts: list[_Layout] = []
    probed: dict[type[Any], _Layout] = {}
    for module, logits_at in found:
        if any(module is m for m in modules):
            continue  # matched by two recorders
        if type(module) not in probed:
            weight = getattr(module, "weight", None)
            hidden = weight.shape[-1] if weight is not None and weight.dim() == 2 else config.hidden_size
            probed[type(module)] = _layout(module, _probe(module, int(hidden)), logits_at)
        modules.append(module)
        layouts.append(probed[type(module)])
    if not modules:
        return None
    return _Routers(tuple(modules), tuple(layouts), *_counts(modules, layouts, config))


def _counts(modules: list[torch.nn.Module], layouts: list[_Layout], config: Any) -> tuple[int, int]:
    """``(top_k, num_experts)``, the same for every router: declared (by the router or the config) and
    for top_k, the columns of the ids each returned when probed."""
    top_ks = {_positive_int((m, config), ("top_k", "num_experts_per_tok")) for m in modules}
    top_ks |= {layout.top_k for layout in layouts}
    experts = {_positive_int((m, config), _EXPERT_COUNT_NAMES) for m in modules}
    if len(top_ks) != 1 or len(experts) != 1 or None in top_ks or None in experts:
        names = sorted({layout.router for layout in layouts})
        raise NotImplementedError(f"routers {names} do not share one top_k and a declared expert count")
    return top_ks.pop() or 0, experts.pop() or 0


def _forward_shape(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, int] | None:
    """``[batch, seq]`` of a model forward's ``input_ids`` or ``inputs_embeds``."""
    for value in (kwargs.get("input_ids"), kwargs.get("inputs_embeds"), args[0] if args else None):
        shape = getattr(value, "shape", None)
        if shape is not None and len(shape) >= 2:
            return int(shape[0]), int(shape[1])
    return None


# -- capture -----------------------------------------------------------------------------------


class RouterCapture:
    """Forward hooks on a model's routers: the experts each forward pass chose, per position.

    Build with :meth:`attach`. Every forward pass of the model appends its routes until
    :meth:`take` or :meth:`discard`: call one of them after each forward, or they accumulate.
    """

    layers: int  # MoE layers (routers), in model order
    top_k: int
    num_experts: int
    dtype: np.dtype[Any]  # route_dtype(num_experts)

    def __init__(self, model: torch.nn.Module, routers: _Routers) -> None:
        """Hooks on ``routers`` (found in ``model`` by :meth:`attach`, which callers use)."""
        self.layers = len(routers.modules)
        self.top_k = routers.top_k
        self.num_experts = routers.num_experts
        self.dtype = route_dtype(routers.num_experts)
        self._shapes: list[tuple[int, int] | None] = []  # [batch, seq] per forward pass
        self._ids: list[list[torch.Tensor]] = [[] for _ in routers.modules]  # per layer, per forward
        self._one_device = len({p.device for router in routers.modules for p in router.parameters()}) <= 1
        self._handles: list[RemovableHandle] = [
            router.register_forward_hook(self._recorder(layer, layout.indices_at))
            for layer, (router, layout) in enumerate(zip(routers.modules, routers.layouts, strict=True))
        ]
        self._handles.append(model.register_forward_pre_hook(self._record_shape, with_kwargs=True))

    @classmethod
    def attach(cls, model: Any) -> RouterCapture | None:
        """Hooks on every router of ``model``; None for a model without experts (nothing attached, nothing paid).

        Raises :class:`NotImplementedError` for a model with experts whose routers cannot be found
        or do not return the ids they chose.
        """
        routers = _discover(model)
        return None if routers is None else cls(model, routers)

    def _recorder(self, layer: int, indices_at: int) -> Callable[[Any, Any, Any], None]:
        ids = self._ids[layer]

        def record(module: Any, args: Any, output: Any) -> None:
            ids.append(output[indices_at].detach())

        return record

    def _record_shape(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._shapes.append(_forward_shape(args, kwargs))

    def take(self) -> np.ndarray[Any, np.dtype[Any]]:
        """The routes of the forward pass(es) since the last take/discard, as [batch, seq, layers, top_k]
        of self.dtype, C-order; clears. Positions as the model saw them (padding included; the caller slices).

        Several forward passes (a prefill in chunks) join along ``seq``; they must share ``batch``.
        None since the last take: an empty ``[0, 0, layers, top_k]``.
        """
        import torch

        shapes = list(self._shapes)
        per_layer = [list(ids) for ids in self._ids]
        self.discard()
        if not shapes and not any(per_layer):
            return np.zeros((0, 0, self.layers, self.top_k), dtype=self.dtype)
        if any(len(ids) != len(shapes) for ids in per_layer) or None in shapes:
            raise RuntimeError(
                f"{len(shapes)} forward pass(es) of the model but {[len(ids) for ids in per_layer]} per router: "
                "a forward failed part-way or a submodule ran alone (discard() after those)"
            )
        known = [shape for shape in shapes if shape is not None]  # == shapes, checked above
        batch = known[0][0]
        if any(b != batch for b, _ in known):
            raise ValueError(f"forward passes of different batch sizes cannot join: {known}")
        # Stacked along dim 1, a forward's ids are [batch * seq, layers, top_k]: already C-order.
        device = per_layer[0][0].device
        forwards = [
            torch.stack([ids[f] if self._one_device else ids[f].to(device) for ids in per_layer], dim=1).reshape(
                b, s, self.layers, self.top_k
            )
            for f, (b, s) in enumerate(known)
        ]
        routes = torch.cat(forwards, dim=1) if len(forwards) > 1 else forwards[0]
        # uint16 has few torch kernels: int16 carries the same 16 bits (a cast wraps), read back as uint16.
        array = routes.to(torch.uint8 if self.dtype == np.uint8 else torch.int16).cpu().numpy()
        return array.view(self.dtype)

    def discard(self) -> None:
        """Forget what was captured (e.g. a forward whose routes are not recorded)."""
        self._shapes.clear()
        for ids in self._ids:
            ids.clear()

    def detach(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.discard()


# -- wire form: pipeline.routes (encode_routes, decode_routes), re-exported here ------------------


# -- replay ------------------------------------------------------------------------------------


def _forced_ids(routes: np.ndarray[Any, np.dtype[Any]] | torch.Tensor, routers: _Routers) -> torch.Tensor:
    """``routes`` as an int64 CPU tensor [batch, seq, layers, top_k], checked against the routers."""
    import torch

    if isinstance(routes, torch.Tensor):
        forced = routes.detach().to("cpu", torch.int64)
    else:
        forced = torch.from_numpy(np.asarray(routes).astype(np.int64))
    if forced.dim() == 3:
        forced = forced.unsqueeze(0)
    if forced.dim() != 4 or tuple(forced.shape[2:]) != (len(routers.modules), routers.top_k):
        raise ValueError(
            f"routes must be [seq, {len(routers.modules)}, {routers.top_k}] or [batch, seq, "
            f"{len(routers.modules)}, {routers.top_k}] (layers, top_k), got {list(forced.shape)}"
        )
    if forced.numel() and (int(forced.min()) < 0 or int(forced.max()) >= routers.num_experts):
        raise ValueError(f"routes hold expert ids outside [0, {routers.num_experts})")
    return forced


def _replayer(
    layout: _Layout, weighting: _Weighting, forced: torch.Tensor
) -> Callable[[Any, Any, tuple[Any, ...]], tuple[Any, ...]]:
    assert layout.logits_at is not None and layout.scores_at is not None
    logits_at, scores_at, indices_at = layout.logits_at, layout.scores_at, layout.indices_at

    def replace(module: Any, args: Any, output: tuple[Any, ...]) -> tuple[Any, ...]:
        logits = output[logits_at]
        if logits.shape[0] != forced.shape[0]:
            raise ValueError(f"{layout.router} routes {logits.shape[0]} positions; forced routes hold {len(forced)}")
        replaced = list(output)
        replaced[scores_at] = _weights(logits, forced, weighting)
        replaced[indices_at] = forced
        return tuple(replaced)

    return replace


@contextmanager
def replay_routes(model: Any, routes: np.ndarray[Any, np.dtype[Any]] | torch.Tensor) -> Iterator[None]:
    """Within the block, every forward pass of ``model`` uses the given experts instead of choosing.

    ``routes`` is [seq, layers, top_k] (one sequence) or [batch, seq, layers, top_k], aligned with the
    forward's input_ids positions (a forward of another [batch, seq] raises ValueError). The routing
    weights are the router's own softmax probabilities at the forced experts (renormalised over the
    top-k when the router does, as norm_topk_prob), so that with the routes the model chose itself the
    output is bit-identical to free routing. A :class:`RouterCapture` on the model records the forced
    experts (the replay hooks run first). Raises ValueError for a model without experts or routes of
    the wrong shape or range, NotImplementedError for routers it cannot force.
    """
    routers = _discover(model)
    if routers is None:
        raise ValueError(f"{type(model).__name__} has no experts to route")
    for layout in routers.layouts:
        if layout.weighting is None:
            raise NotImplementedError(
                f"{layout.router} cannot be replayed: it must return (logits, weights, ids) with weights the "
                "softmax of the logits at the ids (renormalised or not)"
            )
    forced = _forced_ids(routes, routers)
    batch, seq = int(forced.shape[0]), int(forced.shape[1])

    def check_shape(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        shape = _forward_shape(args, kwargs)
        if shape != (batch, seq):
            raise ValueError(f"a forward over [batch, seq] = {shape} while replaying routes for {[batch, seq]}")

    handles: list[RemovableHandle] = []
    try:
        for layer, (router, layout) in enumerate(zip(routers.modules, routers.layouts, strict=True)):
            assert layout.weighting is not None
            param = next(router.parameters(), None)
            ids = forced[:, :, layer, :].reshape(batch * seq, routers.top_k)
            ids = ids.to(param.device) if param is not None else ids
            handles.append(router.register_forward_hook(_replayer(layout, layout.weighting, ids), prepend=True))
        handles.append(model.register_forward_pre_hook(check_shape, with_kwargs=True))
        yield
    finally:
        for handle in handles:
            handle.remove()
