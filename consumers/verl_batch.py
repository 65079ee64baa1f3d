"""verl training batches from trajectories: the padded ``DataProto`` layout and the jagged ``TensorDict`` one.

Both layouts follow verl 0.9.1's own code, not a reading of its docs:

* **Padded** (:func:`padded_batch`, :func:`to_data_proto`): what
  ``verl.experimental.agent_loop.agent_loop.AgentLoopWorker._agent_loop_postprocess`` and
  ``_postprocess`` build. ``prompts`` left-padded with the pad id, ``responses`` right-padded,
  ``attention_mask`` = the two pad masks side by side, ``position_ids`` =
  ``verl.utils.model.compute_position_id_with_mask(attention_mask)`` (cumsum - 1, clipped at 0),
  ``response_mask`` = mask x response attention mask (int64), ``rollout_log_probs`` float32
  zero-padded, ``rm_scores`` float32 with the reward at ``attention_mask[:, P:].sum(1) - 1``.
  The tests run those two verl methods on the same rows and get the same tensors, bit for bit;
  to them we add ``reasoning_mask`` (below).
* **Jagged** (:func:`to_jagged_tensordict`): what verl's v1 trainers keep per sample
  (``verl.trainer.ppo.v1.agent_loop_tq.AgentLoopWorkerTQ._agent_loop_postprocess``, which stores
  ``AgentLoopOutput.as_dict()`` plus ``loss_mask``/``input_ids``/``position_ids``, stacked by
  ``verl.utils.tensordict_utils.list_of_dict_to_tensordict``): every per-token field is a
  ``torch.jagged`` nested tensor of the sample's real length, no padding anywhere. Its
  ``input_ids``/``position_ids`` equal what ``verl.workers.utils.padding.left_right_2_no_padding``
  makes of the padded batch (the tests check both constructions against verl's own).

Where this module deliberately differs from verl's agent loop, and why:

* ``rm_scores`` is always present: a trajectory without a reward (``reward=None``, kept by policy)
  scores 0.0. verl leaves ``rm_scores`` out of a batch unless every row has a score, and then
  computes rewards itself; our rewards were joined upstream, so a batch never waits for them.
* ``__num_turns__`` counts messages the way verl's agent loops do (``ToolAgentLoop``:
  ``user_turns + assistant_turns + 1``; ``SingleTurnAgentLoop``: 2): the first prompt, each
  generation, and each insertion between generations (tool results, user messages), i.e.
  ``2 * trajectory.num_turns``. It is not the number of generations.
* A row must have a non-empty prompt and a non-empty response: verl's ``no_padding_2_padding``
  asserts ``prompt_len > 0``, and ``AgentLoopOutput.as_dict`` cannot place the reward of an
  empty response (``rm_scores[-1]`` of an empty tensor). Dropping such rows is the batcher's job.
* No ``raw_prompt`` (we have token ids, not the dataset's messages) and no ``metrics`` per row.
* ``reasoning_mask`` (int64, laid out exactly as ``response_mask``: 1 on response ids that are a
  reasoning model's thinking, 0 elsewhere and on padding) is ours: verl has no notion of it. The
  thinking ids stay in ``response_mask``, so verl trains on them as on any sampled id; a trainer
  that wants them out or weighted uses ``response_mask * (1 - reasoning_mask)`` or
  ``response_mask * (1 - (1 - w) * reasoning_mask)``. verl reads only the keys it names, so the
  extra one changes nothing there, and its batch operations (concat, repeat, chunk, union) carry
  it along.

Routed experts (Rollout Routing Replay, "R3"), as read in verl 0.9.1: a batch whose every row
has :attr:`~consumers.trajectory.Trajectory.routed_experts` carries them under verl's own key
``routed_experts``, int16 (verl casts to it: ``.to(torch.int16)``), one row per ``input_ids``
position:

* padded: ``[B, P+R, layers, top_k]``, the row of column j being the route of ``input_ids[:, j]``,
  zero on the left padding, the right padding and the last real token (which was never fed to
  the model): what ``AgentLoopWorker._agent_loop_postprocess`` builds
  (``verl/experimental/agent_loop/agent_loop.py`` 785-809: zeros of ``[1, P+R, L, K]``, the
  rollout's rows written from ``start_pos = P - len(prompt_ids)``) and ``_postprocess``
  concatenates (line 1075);
* jagged: per row ``[len(prompt) + len(response), layers, top_k]`` with the last row zero, on
  the same offsets as ``input_ids``: what ``AgentLoopOutput.as_dict`` keeps for the v1 trainer
  (agent_loop.py 129-141: the rows aligned to the whole sequence, trailing rows zero; stored by
  ``verl/trainer/ppo/v1/agent_loop_tq.py`` 183-199) and what
  ``verl/workers/utils/padding.py`` ``left_right_2_no_padding`` (73-79) makes of the padded key.

Megatron replays them with ``actor_rollout_ref.actor.megatron.router_replay.mode=R3``
(``actor_rollout_ref.rollout.enable_rollout_routing_replay=True``, set in verl's R3 runs, is read
only by verl's own vLLM/SGLang rollout servers, to make them return routes; here the gateway did):
``verl/utils/megatron/router_replay_utils.py`` ``align_r3_router_replay_data`` (399-431) takes
per-sample routes as long as the input (as here) or one shorter, and ``build_r3_replay_mask``
replays every row but the last. A batch mixing rows with and without routes is a
:class:`ValueError` naming a row without (verl's ``_postprocess`` concatenates every row's routes
when the first row has some, and fails on a row without); a batch with none has no key.

LoRA adapters: every row names the adapter that sampled it, ``adapter`` (``None``: the base
model), a per-row non-tensor like ``uid`` in both layouts, so that a trainer can check that a
batch is its adapter's (the batcher never mixes adapters in a batch; these functions do not
refuse a mix, which a multi-adapter trainer may build on purpose).

Images (vision-language models), as verl 0.9.1's agent loop lays them out for a Qwen2-VL-style
model (the lines followed are in :mod:`consumers.verl_vision`): given each row's images, resolved
from the image bucket and checked against their pixel digests (:mod:`consumers.images`),
``non_tensor_batch["multi_modal_inputs"]`` holds per row ``pixel_values`` (float32 [patches,
dim]), ``image_grid_thw`` (int64 [images, 3]) and ``images_seqlens``, or ``{}`` for a row without
images; ``position_ids`` become ``[B, 4, P+R]`` (padded; jagged: ``[4, len]`` per row) for the
whole batch as soon as one row has an image: text positions (1 on padding), then the model's
three rotary axes from ``get_rope_index`` over the row's attention mask. A batch without images is
laid out exactly as before (2-D positions, empty dicts). No ``multi_modal_data``: verl's padded
``_postprocess`` (agent_loop.py 1057-1140) never puts it into the batch, and the v1 per-sample
layout drops it (``verl/trainer/ppo/v1/agent_loop_tq.py`` 197: "do not store raw image/video");
only the rollout and teacher paths, which a stream batch skips, read it.

verl and tensordict are optional (the ``verl`` extra): they are imported inside the functions
that need them. ``import verl`` pulls in ray, sets up the root logger
(``logging.basicConfig``) and takes seconds, so nothing here imports it at module import time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch

from .grouping import group_uid
from .trajectory import Trajectory
from .verl_vision import mrope_position_ids, multi_modal_inputs

if TYPE_CHECKING:
    from tensordict import TensorDict
    from verl.protocol import DataProto

    from .images import ResolvedImage

__all__ = [
    "PaddedBatch",
    "group_uid",
    "padded_batch",
    "to_data_proto",
    "to_jagged_tensordict",
]

# verl's AgentLoopWorker._postprocess always fills these per-row keys (None where unknown), so that
# batches from different agent loops concatenate; we fill them too.
_EXTRA_FIELD_KEYS = ("turn_scores", "tool_rewards", "min_global_steps", "max_global_steps", "extras")


@dataclass(frozen=True, slots=True)
class PaddedBatch:
    """A batch in verl's padded layout: the three parts of a ``DataProto``.

    ``tensors`` (B rows, P = ``prompt_length``, R = ``response_length``): ``prompts`` [B,P] and
    ``responses`` [B,R] int64; ``response_mask`` and ``reasoning_mask`` (1 on thinking ids, a
    subset of ``response_mask``) [B,R] int64; ``input_ids``, ``attention_mask``, ``position_ids``
    [B,P+R] int64 (``position_ids`` [B,4,P+R] when a row has images: text positions, then the
    three multimodal rotary axes, :mod:`consumers.verl_vision`); ``rollout_log_probs`` and
    ``rm_scores`` [B,R] float32; when every row has routes, ``routed_experts``
    [B,P+R,layers,top_k] int16 aligned with ``input_ids`` (see the module docstring).

    ``non_tensors``: one-dimensional arrays of length B: ``uid``, ``trajectory_id``,
    ``session_id`` (str, dtype object); ``adapter`` (the LoRA adapter's name, ``None`` for the base
    model, dtype object); ``__num_turns__`` (int32, as verl); ``multi_modal_inputs``
    (per row a dict: ``pixel_values``, ``image_grid_thw`` and ``images_seqlens`` for a row with
    images, empty otherwise; verl's trainer iterates it unconditionally); ``turn_scores`` (turn-level
    rewards in turn order), ``tool_rewards`` (empty lists), ``min_global_steps`` and
    ``max_global_steps`` (the policy versions the trajectory spans), ``extras`` (None), all
    dtype object as verl's ``extra_fields``; ``sg.end_reason`` (the trajectory's end reason, str or
    None) and ``sg.health`` (its record-health flags, a list per row), dtype object;
    ``policy_versions``: per row an int64 array of length R,
    the policy version that sampled each response token (-1 where nothing was sampled, padding
    included), so a trainer can weight or mask stale tokens (``np.stack`` gives [B,R]).

    ``meta_info``: ``timing`` (empty; verl's trainer pops it) and ``reward_extra_keys`` (empty).
    """

    tensors: dict[str, torch.Tensor]
    non_tensors: dict[str, npt.NDArray[Any]]
    meta_info: dict[str, Any]

    def __len__(self) -> int:
        return int(self.tensors["input_ids"].shape[0])


@dataclass(frozen=True, slots=True)
class _Row:
    """One trajectory cut where verl cuts it: the first prompt, and everything after."""

    prompt: list[int]
    response: list[int]
    mask: list[int]
    logprobs: list[float]
    reasoning: list[int]
    routes: npt.NDArray[Any] | None  # [len(prompt) + len(response) - 1, layers, top_k]: every id but the last


def padded_batch(
    trajectories: Sequence[Trajectory],
    uids: Sequence[str],
    *,
    prompt_length: int,
    response_length: int,
    pad_token_id: int,
    images: Sequence[Sequence[ResolvedImage]] | None = None,
) -> PaddedBatch:
    """The padded layout of verl's agent loop (see the module docstring) for ``trajectories``.

    ``uids[i]`` is row i's group id (GRPO's ``index``). A prompt longer than ``prompt_length`` or
    a response longer than ``response_length`` is a :class:`ValueError`: truncating or dropping
    is the batcher's decision, made before this. ``images[i]``: row i's images as
    :meth:`consumers.images.ImageStore.resolve` returns them, needed when a row has any.
    """
    if prompt_length < 1 or response_length < 1:
        raise ValueError(f"prompt_length and response_length must be >= 1, got {prompt_length}, {response_length}")
    rows = _rows(trajectories, uids)
    resolved = _resolved(trajectories, images)
    size = len(rows)
    versions = np.full((size, response_length), -1, dtype=np.int64)
    prompts = torch.full((size, prompt_length), pad_token_id, dtype=torch.int64)
    responses = torch.full((size, response_length), pad_token_id, dtype=torch.int64)
    prompt_attention = torch.zeros((size, prompt_length), dtype=torch.int64)
    response_attention = torch.zeros((size, response_length), dtype=torch.int64)
    response_mask = torch.zeros((size, response_length), dtype=torch.int64)
    reasoning_mask = torch.zeros((size, response_length), dtype=torch.int64)
    rollout_log_probs = torch.zeros((size, response_length), dtype=torch.float32)
    for i, (trajectory, row) in enumerate(zip(trajectories, rows, strict=True)):
        if len(row.prompt) > prompt_length:
            raise ValueError(
                f"trajectory {trajectory.trajectory_id}: prompt of {len(row.prompt)} tokens is longer than "
                f"prompt_length={prompt_length} (truncate or drop it before batching)"
            )
        if len(row.response) > response_length:
            raise ValueError(
                f"trajectory {trajectory.trajectory_id}: response of {len(row.response)} tokens is longer than "
                f"response_length={response_length} (truncate or drop it before batching)"
            )
        p, r = len(row.prompt), len(row.response)
        prompts[i, prompt_length - p :] = torch.tensor(row.prompt, dtype=torch.int64)
        prompt_attention[i, prompt_length - p :] = 1
        responses[i, :r] = torch.tensor(row.response, dtype=torch.int64)
        response_attention[i, :r] = 1
        mask = torch.tensor(row.mask, dtype=torch.int64)
        response_mask[i, :r] = mask
        reasoning_mask[i, :r] = torch.tensor(row.reasoning, dtype=torch.int64)
        # Non-sampled positions carry 0.0 (contract T1); enforced here rather than trusted.
        logprobs = torch.tensor(row.logprobs, dtype=torch.float32)
        rollout_log_probs[i, :r] = torch.where(mask.bool(), logprobs, torch.zeros_like(logprobs))
        versions[i, :r] = trajectory.token_policy_versions()[len(row.prompt) :]
    attention_mask = torch.cat([prompt_attention, response_attention], dim=1)
    input_ids = torch.cat([prompts, responses], dim=1)
    if resolved is None:
        # verl.utils.model.compute_position_id_with_mask, as the agent loop uses for text-only models.
        position_ids = torch.clip(torch.cumsum(attention_mask, dim=-1) - 1, min=0)
    else:  # AgentLoopWorker._compute_position_ids per row, concatenated by _postprocess: [B, 4, P+R]
        position_ids = torch.cat(
            [
                mrope_position_ids(input_ids[i : i + 1], attention_mask[i : i + 1], row_images, _merge_size(row_images))
                for i, row_images in enumerate(resolved)
            ]
        )
    # AgentLoopWorker._postprocess: the score sits at the last valid response position.
    rm_scores = torch.zeros((size, response_length), dtype=torch.float32)
    last = response_attention.sum(dim=1) - 1
    rm_scores[torch.arange(size), last] = torch.tensor([_reward(t) for t in trajectories], dtype=torch.float32)
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "response_mask": response_mask,
        "reasoning_mask": reasoning_mask,
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "rollout_log_probs": rollout_log_probs,
        "rm_scores": rm_scores,
    }
    if (routes := _routes(trajectories, rows)) is not None:
        # AgentLoopWorker._agent_loop_postprocess: zeros, the rows written from the first prompt id.
        layers, top_k = routes[0].shape[1:]
        routed_experts = torch.zeros((size, prompt_length + response_length, layers, top_k), dtype=torch.int16)
        for i, (row, rows_of_routes) in enumerate(zip(rows, routes, strict=True)):
            start = prompt_length - len(row.prompt)
            routed_experts[i, start : start + len(rows_of_routes)] = rows_of_routes
        tensors["routed_experts"] = routed_experts
    non_tensors: dict[str, npt.NDArray[Any]] = {
        "uid": _objects(list(uids)),
        "__num_turns__": np.array([_verl_num_turns(t) for t in trajectories], dtype=np.int32),
        "trajectory_id": _objects([t.trajectory_id for t in trajectories]),
        "session_id": _objects([t.session_id for t in trajectories]),
        "adapter": _objects([t.adapter for t in trajectories]),
        "multi_modal_inputs": _objects([multi_modal_inputs(r) for r in resolved or [()] * size]),
        "policy_versions": _objects(list(versions)),
        # What the row says about itself (docs/batches.md): why it ends, and its record-health flags.
        "sg.end_reason": _objects([t.end_reason for t in trajectories]),
        "sg.health": _objects([list(t.health) for t in trajectories]),
    }
    extra = [_extra_fields(t) for t in trajectories]
    for key in _EXTRA_FIELD_KEYS:
        non_tensors[key] = _objects([e[key] for e in extra])
    return PaddedBatch(tensors, non_tensors, {"timing": {}, "reward_extra_keys": []})


def to_data_proto(batch: PaddedBatch) -> DataProto:
    """The batch as a ``verl.protocol.DataProto`` (its ``check_consistency`` runs on construction).

    The tensors are shared, not copied; the dicts are (``DataProto.from_dict`` mutates them).
    """
    from verl.protocol import DataProto

    proto: DataProto = DataProto.from_dict(
        tensors=dict(batch.tensors), non_tensors=dict(batch.non_tensors), meta_info=dict(batch.meta_info)
    )
    return proto


def to_jagged_tensordict(
    trajectories: Sequence[Trajectory], uids: Sequence[str], images: Sequence[Sequence[ResolvedImage]] | None = None
) -> TensorDict:
    """The trajectories in the per-sample, no-padding layout of verl's v1 trainers.

    Nested (``torch.jagged``) tensors, one component per row at its real length: ``prompts``,
    ``responses``, ``response_mask`` and ``loss_mask`` (the same values, as verl v1 keeps both),
    ``reasoning_mask`` (1 on response ids that are thinking, a subset of ``response_mask``),
    ``input_ids`` (prompt + response), ``position_ids`` (``0..len-1``), all int64;
    ``rollout_log_probs`` and ``rm_scores`` (the reward on the last response token) float32.
    Per-row non-tensor data (``NonTensorStack``): ``uid``, ``num_turns`` (counted as verl does, see
    the module docstring), ``trajectory_id``, ``session_id`` (ours, a string; verl v1's agent loop
    uses a ``session_id`` of its own, the rollout index, only to build TransferQueue keys),
    ``adapter`` (the LoRA adapter's name, ``None`` for the base model), ``extra_fields`` (a dict
    with ``turn_scores``, ``tool_rewards``, ``min_global_steps``, ``max_global_steps``,
    ``extras``) and ``multi_modal_inputs`` (a dict per row, as in :class:`PaddedBatch`; ``images``
    as for :func:`padded_batch`); ``policy_versions``
    (nested int64, per response token: the version that sampled it, -1 where nothing was). When
    every row has routes, ``routed_experts``: nested int16, per row ``[len(input_ids), layers,
    top_k]``, the last row zero (see the module docstring). When a row has images, ``position_ids``
    is per row ``[4, len]`` (``AgentLoopWorkerTQ._agent_loop_postprocess``: ``_compute_position_ids``
    of the whole unpadded row, squeezed). No length limits: nothing is padded.
    """
    from tensordict import NonTensorData, NonTensorStack, TensorDict

    rows = _rows(trajectories, uids)
    resolved = _resolved(trajectories, images)

    def nested(values: list[list[int]] | list[list[float]], dtype: torch.dtype) -> torch.Tensor:
        return torch.nested.as_nested_tensor([torch.tensor(v, dtype=dtype) for v in values], layout=torch.jagged)

    def stack(values: list[Any]) -> Any:
        return NonTensorStack.from_list([NonTensorData(v) for v in values])

    masks = [row.mask for row in rows]
    source: dict[str, Any] = {
        "prompts": nested([row.prompt for row in rows], torch.int64),
        "responses": nested([row.response for row in rows], torch.int64),
        "response_mask": nested(masks, torch.int64),
        "loss_mask": nested(masks, torch.int64),
        "reasoning_mask": nested([row.reasoning for row in rows], torch.int64),
        "input_ids": nested([row.prompt + row.response for row in rows], torch.int64),
        "position_ids": _jagged_positions(rows, resolved),
        "rollout_log_probs": nested(
            [[lp if m else 0.0 for lp, m in zip(row.logprobs, row.mask, strict=True)] for row in rows],
            torch.float32,
        ),
        "rm_scores": nested(
            [[0.0] * (len(row.response) - 1) + [_reward(t)] for t, row in zip(trajectories, rows, strict=True)],
            torch.float32,
        ),
        "policy_versions": nested(
            [t.token_policy_versions()[len(row.prompt) :] for t, row in zip(trajectories, rows, strict=True)],
            torch.int64,
        ),
        "uid": stack(list(uids)),
        "num_turns": stack([_verl_num_turns(t) for t in trajectories]),
        "trajectory_id": stack([t.trajectory_id for t in trajectories]),
        "session_id": stack([t.session_id for t in trajectories]),
        "adapter": stack([t.adapter for t in trajectories]),
        "extra_fields": stack([_extra_fields(t) for t in trajectories]),
        "multi_modal_inputs": stack([multi_modal_inputs(r) for r in resolved or [()] * len(rows)]),
    }
    if (routes := _routes(trajectories, rows)) is not None:
        # AgentLoopOutput.as_dict: aligned to the whole sequence, the rows it has not (the last) zero.
        source["routed_experts"] = torch.nested.as_nested_tensor(
            [torch.cat([r, r.new_zeros((1, *r.shape[1:]))]) for r in routes], layout=torch.jagged
        )
    return TensorDict(source, batch_size=[len(rows)])


def _jagged_positions(rows: Sequence[_Row], resolved: list[Sequence[ResolvedImage]] | None) -> torch.Tensor:
    lengths = [len(row.prompt) + len(row.response) for row in rows]
    if resolved is None:
        values = [torch.arange(n, dtype=torch.int64) for n in lengths]
    else:
        values = []
        for row, row_images in zip(rows, resolved, strict=True):
            ids = torch.tensor([row.prompt + row.response], dtype=torch.int64)
            values.append(mrope_position_ids(ids, torch.ones_like(ids), row_images, _merge_size(row_images))[0])
    return torch.nested.as_nested_tensor(values, layout=torch.jagged)


def _resolved(
    trajectories: Sequence[Trajectory], images: Sequence[Sequence[ResolvedImage]] | None
) -> list[Sequence[ResolvedImage]] | None:
    """Each row's resolved images, checked against its trajectory; ``None``: no row has any."""
    if images is None:
        if any(t.images for t in trajectories):
            raise ValueError(
                "a row has images but none were given: resolve them first (consumers.images.ImageStore.resolve_all)"
            )
        return None
    if len(images) != len(trajectories):
        raise ValueError(f"images for {len(images)} rows, not {len(trajectories)}")
    for trajectory, row_images in zip(trajectories, images, strict=True):
        if [image.record for image in row_images] != trajectory.images:
            raise ValueError(f"trajectory {trajectory.trajectory_id}: the images given are not its images")
    return list(images) if any(images) else None


def _merge_size(row_images: Sequence[ResolvedImage]) -> int:
    """A row's spatial merge: its images' processor's (any number for a row without images)."""
    return row_images[0].merge_size if row_images else 1


def _rows(trajectories: Sequence[Trajectory], uids: Sequence[str]) -> list[_Row]:
    if not trajectories:
        raise ValueError("a batch needs at least one trajectory")
    if len(uids) != len(trajectories):
        raise ValueError(f"{len(uids)} uids for {len(trajectories)} trajectories")
    return [_row(t) for t in trajectories]


def _row(trajectory: Trajectory) -> _Row:
    ids, mask, logprobs, p = trajectory.token_ids, trajectory.loss_mask, trajectory.logprobs, trajectory.prompt_length
    where = f"trajectory {trajectory.trajectory_id}"
    if not len(ids) == len(mask) == len(logprobs):
        raise ValueError(f"{where}: {len(ids)} token ids, {len(mask)} mask values and {len(logprobs)} logprobs")
    if any(m not in (0, 1) for m in mask):
        raise ValueError(f"{where}: loss_mask holds values other than 0 and 1")
    if not 0 < p < len(ids):
        raise ValueError(
            f"{where}: prompt_length {p} of {len(ids)} tokens leaves an empty prompt or response "
            "(verl needs both non-empty)"
        )
    if any(mask[:p]):
        raise ValueError(f"{where}: sampled (mask 1) tokens inside the first prompt would be lost")
    reasoning = trajectory.reasoning_mask
    if len(reasoning) != len(ids):
        raise ValueError(f"{where}: {len(ids)} token ids and {len(reasoning)} reasoning_mask values")
    if any(r not in (0, 1) or (r and not m) for r, m in zip(reasoning, mask, strict=True)):
        raise ValueError(f"{where}: reasoning_mask must be 0 or 1, and 1 only on sampled ids")
    routes = None
    if trajectory.routed_experts is not None:
        if (problem := trajectory.routed_experts.problem(len(ids))) is not None:
            raise ValueError(f"{where}: {problem}")
        routes = trajectory.routed_experts.array()
    return _Row(list(ids[:p]), list(ids[p:]), list(mask[p:]), list(logprobs[p:]), list(reasoning[p:]), routes)


def _routes(trajectories: Sequence[Trajectory], rows: Sequence[_Row]) -> list[torch.Tensor] | None:
    """Every row's routes as int16 (verl's dtype), or ``None`` if no row has any.

    Some rows with and some without, different (layers, top_k), or an expert id over int16's range
    is a :class:`ValueError`.
    """
    arrays = [row.routes for row in rows]
    present = [(t, a) for t, a in zip(trajectories, arrays, strict=True) if a is not None]
    if not present:
        return None
    if len(present) < len(arrays):
        without = next(t for t, a in zip(trajectories, arrays, strict=True) if a is None)
        raise ValueError(
            f"trajectory {without.trajectory_id} has no routed_experts while trajectory {present[0][0].trajectory_id} "
            "of the same batch has: verl replays routes for every row of a batch or for none (batch routed and "
            "unrouted trajectories apart, or drop the routes)"
        )
    shape = present[0][1].shape[1:]
    out = []
    for trajectory, array in present:
        where = f"trajectory {trajectory.trajectory_id}"
        if array.shape[1:] != shape:
            raise ValueError(
                f"{where}: routed_experts of {list(array.shape[1:])} (layers, top_k), not {list(shape)} as row 0's"
            )
        if array.size and int(array.max()) > torch.iinfo(torch.int16).max:
            raise ValueError(f"{where}: an expert id over int16's range (verl's routed_experts dtype)")
        out.append(torch.from_numpy(array.astype(np.int16)))
    return out


def _reward(trajectory: Trajectory) -> float:
    return 0.0 if trajectory.reward is None else trajectory.reward


def _verl_num_turns(trajectory: Trajectory) -> int:
    # The first prompt, each generation, and the insertion between consecutive generations.
    return 2 * trajectory.num_turns


def _extra_fields(trajectory: Trajectory) -> dict[str, Any]:
    return {
        "turn_scores": [turn.reward for turn in trajectory.turns if turn.reward is not None],
        "tool_rewards": [],
        "min_global_steps": trajectory.min_policy_version,
        "max_global_steps": trajectory.max_policy_version,
        "extras": None,
    }


def _objects(values: list[Any]) -> npt.NDArray[Any]:
    # Element by element: numpy would otherwise turn equal-length lists into a 2-D array.
    array = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        array[i] = value
    return array
