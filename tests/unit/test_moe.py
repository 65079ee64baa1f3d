"""Routed-expert capture, its wire form and replay (stream_gateway.moe) on tiny Qwen3-MoE models.

The models are built here from a config with seeded random weights (no built model on disk); the
router weights are drawn at std 1 so that the top-2 choice stands clear of float noise.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.utils.output_capturing import OutputRecorder

from stream_gateway.moe import RouterCapture, decode_routes, encode_routes, replay_routes, route_dtype

VOCAB = 300
LAYERS = 2
TOP_K = 2


def _tiny_moe(num_experts: int = 8, seed: int = 0) -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=num_experts,
        num_experts_per_tok=TOP_K,
        moe_intermediate_size=32 if num_experts <= 8 else 8,
        norm_topk_prob=True,
    )
    model = Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(std=1.0)  # decisive routing (see the module docstring)
    return model


def _gates(model: Qwen3MoeForCausalLM) -> list[nn.Module]:
    return [layer.mlp.gate for layer in model.model.layers]


def _hooks(model: nn.Module) -> int:
    """Forward hooks on ``model`` (transformers adds its own once ``output_router_logits`` was asked for)."""
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def _ids(length: int, seed: int, rows: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def model() -> Qwen3MoeForCausalLM:
    return _tiny_moe()


@pytest.fixture
def capture(model: Qwen3MoeForCausalLM) -> Iterator[RouterCapture]:
    attached = RouterCapture.attach(model)
    assert attached is not None
    yield attached
    attached.detach()


# -- capture -----------------------------------------------------------------------------------


@pytest.mark.parametrize("num_experts", [8, 300])
def test_prefill_routes_are_the_top_k_of_the_router_logits_in_order(num_experts: int) -> None:
    model = _tiny_moe(num_experts)
    capture = RouterCapture.attach(model)
    assert capture is not None
    assert (capture.layers, capture.top_k, capture.num_experts) == (LAYERS, TOP_K, num_experts)
    assert capture.dtype == route_dtype(num_experts)
    with torch.no_grad():
        out = model(input_ids=_ids(40, seed=1), output_router_logits=True)
    routes = capture.take()
    assert routes.shape == (1, 40, LAYERS, TOP_K)
    assert routes.dtype == capture.dtype and routes.flags.c_contiguous
    expected = torch.stack([logits.topk(TOP_K, dim=-1).indices for logits in out.router_logits], dim=1)
    np.testing.assert_array_equal(routes[0], expected.numpy())
    if num_experts > 256:
        assert routes.max() > 255  # ids past a byte survive the int16 round trip
    assert capture.take().shape == (0, 0, LAYERS, TOP_K)  # take cleared


def test_a_prefill_in_chunks_joins_along_the_sequence(model: Qwen3MoeForCausalLM, capture: RouterCapture) -> None:
    ids = _ids(30, seed=2)
    with torch.no_grad():
        model(input_ids=ids)
        whole = capture.take()
        cache = DynamicCache()
        model(input_ids=ids[:, :18], past_key_values=cache, use_cache=True)
        model(input_ids=ids[:, 18:], past_key_values=cache, use_cache=True)
    chunked = capture.take()
    assert chunked.shape == whole.shape == (1, 30, LAYERS, TOP_K)
    np.testing.assert_array_equal(np.sort(chunked, axis=-1), np.sort(whole, axis=-1))
    with torch.no_grad():
        model.model(input_ids=ids)  # the base model alone: its routers ran, the model attached to did not
    with pytest.raises(RuntimeError, match="submodule ran alone"):
        capture.take()
    assert capture.take().shape == (0, 0, LAYERS, TOP_K)


def test_batched_left_padded_decode_routes_each_row_as_alone(
    model: Qwen3MoeForCausalLM, capture: RouterCapture
) -> None:
    """A padded prefill [rows, width], then decode steps [rows, 1] against one DynamicCache: each row's
    routes at its real positions are those of a forward over that row's sequence alone."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (7, 12, 4)]
    rows, width, steps = len(prompts), max(map(len, prompts)), 6
    ids = torch.zeros((rows, width), dtype=torch.long)
    mask = torch.zeros((rows, width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    sequences = [list(prompt) for prompt in prompts]
    cache = DynamicCache()
    with torch.no_grad():
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(1) - 1).clamp(min=0),
            past_key_values=cache,
            use_cache=True,
        )
        prefill = capture.take()
        assert prefill.shape == (rows, width, LAYERS, TOP_K)
        recorded = [list(prefill[row, width - len(prompt) :]) for row, prompt in enumerate(prompts)]
        for _ in range(steps):
            tokens = out.logits[:, -1].argmax(-1)
            for sequence, token in zip(sequences, tokens.tolist(), strict=True):
                sequence.append(token)
            mask = torch.cat([mask, mask.new_ones((rows, 1))], dim=1)
            out = model(
                input_ids=tokens[:, None],
                attention_mask=mask,
                position_ids=torch.tensor([[len(s) - 1] for s in sequences]),
                past_key_values=cache,
                use_cache=True,
            )
            step = capture.take()
            assert step.shape == (rows, 1, LAYERS, TOP_K)
            for row in range(rows):
                recorded[row].append(step[row, 0])

    compared = ties = 0
    for sequence, routes in zip(sequences, recorded, strict=True):
        with torch.no_grad():
            alone = model(input_ids=torch.tensor([sequence]), output_router_logits=True)
        capture.discard()
        top = torch.stack(alone.router_logits, dim=1).topk(TOP_K + 1, dim=-1)  # [positions, layers, k + 1]
        assert len(routes) == len(sequence)
        for position, route in enumerate(routes):
            for layer in range(LAYERS):
                compared += 1
                expected = set(top.indices[position, layer, :TOP_K].tolist())
                if set(route[layer].tolist()) != expected:
                    # Only a near-tie between the k-th and the next expert may differ between batch shapes.
                    gap = float(top.values[position, layer, TOP_K - 1] - top.values[position, layer, TOP_K])
                    assert gap < 1e-4, (position, layer, route[layer], expected)
                    ties += 1
    assert compared == LAYERS * sum(map(len, sequences))
    assert ties == 0


def test_a_dense_model_gets_no_capture() -> None:
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    dense = Qwen2ForCausalLM(config)
    assert RouterCapture.attach(dense) is None
    assert _hooks(dense) == 0
    with pytest.raises(ValueError, match="no experts"), replay_routes(dense, np.zeros((3, 2, 2), np.uint8)):
        pass


class _LogitsOnlyRouter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 8))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight)


class _LogitsOnlyModel(nn.Module):
    _can_record_outputs: ClassVar[dict[str, Any]] = {"router_logits": OutputRecorder(_LogitsOnlyRouter, index=0)}

    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(num_experts=4, num_experts_per_tok=2, hidden_size=8)
        self.gate = _LogitsOnlyRouter()


def test_routers_that_return_no_ids_and_unfound_routers_are_refused() -> None:
    with pytest.raises(NotImplementedError, match="_LogitsOnlyRouter returns no expert ids"):
        RouterCapture.attach(_LogitsOnlyModel())
    undeclared = nn.Module()
    undeclared.config = SimpleNamespace(n_routed_experts=16)  # type: ignore[assignment]
    with pytest.raises(NotImplementedError, match="declares no router_logits recorder"):
        RouterCapture.attach(undeclared)


# -- wire form ---------------------------------------------------------------------------------


def test_route_dtype_fits_the_expert_count() -> None:
    assert route_dtype(8) == np.uint8
    assert route_dtype(256) == np.uint8
    assert route_dtype(257) == np.uint16
    assert route_dtype(65536) == np.uint16
    for bad in (0, 65537):
        with pytest.raises(ValueError):
            route_dtype(bad)


def test_routes_round_trip_on_the_wire() -> None:
    rng = np.random.default_rng(0)
    narrow = rng.integers(0, 8, (7, 2, 2)).astype(np.uint8)
    wire = encode_routes(narrow)
    assert wire["shape"] == [7, 2, 2] and wire["dtype"] == "uint8"
    assert base64.b64decode(wire["data"]) == narrow.tobytes()
    back = decode_routes(json.loads(json.dumps(wire)))
    assert back.dtype == np.uint8 and back.flags.writeable
    np.testing.assert_array_equal(back, narrow)

    wide = rng.integers(0, 300, (5, 3, 4)).astype(np.uint16)
    wire = encode_routes(wide)
    assert wire["dtype"] == "uint16"
    assert base64.b64decode(wire["data"]) == wide.astype("<u2").tobytes()
    assert encode_routes(wide.astype(">u2")) == wire  # little-endian on the wire, whatever the host
    assert encode_routes(np.asfortranarray(wide)) == wire  # C order
    np.testing.assert_array_equal(decode_routes(wire), wide)
    assert decode_routes(encode_routes(np.zeros((0, 3, 4), np.uint16))).shape == (0, 3, 4)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"dtype": "int32"}, "dtype must be"),
        ({"dtype": None}, "dtype must be"),
        ({"shape": [7, 4]}, "three non-negative ints"),
        ({"shape": [7, 2, -2]}, "three non-negative ints"),
        ({"shape": [7, 2, True]}, "three non-negative ints"),
        ({"shape": [7, 2, 3]}, "holds 28 bytes"),
        ({"dtype": "uint16"}, "holds 28 bytes"),
        ({"data": "not base64!"}, "not valid base64"),
        ({"data": b"AAAA"}, "base64 string"),
    ],
)
def test_decoding_bad_routes_says_what_is_wrong(change: dict[str, Any], message: str) -> None:
    wire = encode_routes(np.zeros((7, 2, 2), np.uint8)) | change
    with pytest.raises(ValueError, match=message):
        decode_routes(wire)


def test_encoding_refuses_other_dtypes_and_ranks() -> None:
    with pytest.raises(ValueError, match="uint8 or uint16"):
        encode_routes(np.zeros((3, 2, 2), np.int64))
    with pytest.raises(ValueError, match="positions, layers, top_k"):
        encode_routes(np.zeros((3, 4), np.uint8))


# -- replay ------------------------------------------------------------------------------------


def test_replay_reproduces_free_routing_and_forces_routes_after_an_update() -> None:
    model = _tiny_moe(seed=4)
    capture = RouterCapture.attach(model)
    assert capture is not None
    ids = _ids(48, seed=5)
    with torch.no_grad():
        free = model(input_ids=ids).logits
        recorded = capture.take()[0]
        with replay_routes(model, recorded):
            replayed = model(input_ids=ids).logits
        assert torch.equal(replayed, free)  # bit-identical with the model's own choices
        np.testing.assert_array_equal(capture.take()[0], recorded)

        for gate in _gates(model):  # a weight update moves the routers
            gate.weight.add_(torch.randn(gate.weight.shape, generator=torch.Generator().manual_seed(6)))
        updated = model(input_ids=ids).logits
        rerouted = capture.take()[0]
        moved = (np.sort(rerouted, -1) != np.sort(recorded, -1)).any(-1)  # [positions, layers]
        assert 0 < moved.sum() < moved.size
        assert not torch.equal(updated, free)

        with replay_routes(model, torch.from_numpy(recorded)):
            forced = model(input_ids=ids).logits
        np.testing.assert_array_equal(capture.take()[0], recorded)  # the recorded experts, not the new choice
        assert not torch.allclose(forced, updated)
        with replay_routes(model, rerouted):
            assert torch.equal(model(input_ids=ids).logits, updated)
        capture.take()
    assert _hooks(model) == LAYERS + 1  # replay's are gone; the capture's remain
    capture.detach()
    assert _hooks(model) == 0


def test_forced_experts_are_weighted_by_the_router_softmax(model: Qwen3MoeForCausalLM) -> None:
    """One sparse block run alone under replay equals its two forced experts weighed by hand."""
    block = model.model.layers[0].mlp
    hidden = torch.randn(1, 6, 64, generator=torch.Generator().manual_seed(7))
    pair = [3, 6]
    routes = np.tile(np.array(pair, np.uint8), (6, LAYERS, 1))
    with torch.no_grad(), replay_routes(model, routes):
        out = block(hidden).view(6, 64)
    flat = hidden.view(6, 64)
    with torch.no_grad():
        weights = torch.softmax(F.linear(flat, block.gate.weight).float(), dim=-1)[:, pair]
        weights = weights / weights.sum(-1, keepdim=True)
        manual = torch.zeros_like(flat)
        for slot, expert in enumerate(pair):
            gate, up = F.linear(flat, block.experts.gate_up_proj[expert]).chunk(2, dim=-1)
            hidden_e = F.linear(block.experts.act_fn(gate) * up, block.experts.down_proj[expert])
            manual += weights[:, slot : slot + 1] * hidden_e
    torch.testing.assert_close(out, manual, rtol=1e-5, atol=1e-6)


def test_replay_refuses_routes_that_do_not_fit(model: Qwen3MoeForCausalLM) -> None:
    hooks = _hooks(model)
    with pytest.raises(ValueError, match="layers, top_k"), replay_routes(model, np.zeros((5, 3, 2), np.uint8)):
        pass
    with pytest.raises(ValueError, match="outside"), replay_routes(model, np.full((5, 2, 2), 8, np.uint8)):
        pass
    with torch.no_grad(), replay_routes(model, np.zeros((5, 2, 2), np.uint8)):
        with pytest.raises(ValueError, match="while replaying"):
            model(input_ids=_ids(6, seed=8))
        with pytest.raises(ValueError, match="while replaying"):
            model(input_ids=_ids(5, seed=8, rows=2))
        model(input_ids=_ids(5, seed=8))
    assert _hooks(model) == hooks
