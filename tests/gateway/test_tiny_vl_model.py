"""tiny-vl: the Qwen2-VL test model's build, its processor and template, and what it says.

The processor, the vision tokens and the template are tiny-vl's build code, not what it learned:
those tests run by default on ``tiny-vl-untrained`` (built in seconds; every file but its weights
the same bytes as tiny-vl's, tests/unit/test_model_digests.py). What the trained model says, and
its assembly, are marked ``trained`` (``pytest -m trained``): what runs is loading it from its
shipped weights and a few hundred single-sequence CPU forward passes, each fed exactly as the
gateway feeds it: the template's one ``<|image_pad|>`` per image expanded to
``image_grid_thw.prod() // 4`` pads, ``pixel_values`` and ``image_grid_thw`` from the saved image
processor, ``mm_token_type_ids`` marking the pads. A greedy reply is checked by teacher forcing:
greedy decoding yields the expected reply exactly when every position along it predicts its token.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

from stream_gateway.models import (
    AGENT_AFTER_TOOL,
    AGENT_TOOL_CALL,
    AGENT_WITHOUT_TOOLS,
    MARKER_FILE,
    SHIPPED_WEIGHTS,
    VL_COLOURS,
    build_tiny_agent_model,
    build_tiny_model,
    build_tiny_vl_model,
    default_cache_dir,
    resolve_model,
    vl_answer,
    vl_image,
)

PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
END = "<|im_end|>"
READ: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "read",
        "description": "Read the contents of a file.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    },
}
BASH: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Execute a bash command in the current working directory.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
    },
}
TOOLS = [READ, BASH]
CALL: dict[str, Any] = {"type": "function", "function": {"name": "read", "arguments": {"path": "README.md"}}}


@pytest.fixture(scope="module")
def tokenizer(vl_model_path: Path) -> Any:
    """tiny-vl-untrained's tokenizer and template (tiny-vl's)."""
    return AutoTokenizer.from_pretrained(vl_model_path, local_files_only=True)


@pytest.fixture(scope="module")
def processor(vl_model_path: Path) -> Any:
    """tiny-vl-untrained's image processor (tiny-vl's)."""
    return AutoProcessor.from_pretrained(vl_model_path, local_files_only=True)  # type: ignore[no-untyped-call]


@pytest.fixture(scope="module")
def vl_dir() -> Path:
    """The trained tiny-vl (only its own tests, marked ``trained``, ask for it)."""
    return build_tiny_vl_model()


@pytest.fixture(scope="module", params=["shipped", "recipe"])
def trained(
    request: pytest.FixtureRequest, vl_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Any, Any, Any]:
    """tiny-vl's network, tokenizer and processor, each loaded from its own directory: the shipped
    model, and the model its recipe (model_recipes) trains now, which must have learned the same
    (one to two minutes on two cores; other CPUs may train other bytes, not another repertoire)."""
    directory = vl_dir
    if request.param == "recipe":
        from model_recipes import build_model

        directory = tmp_path_factory.mktemp("recipe") / "tiny-vl"
        directory.mkdir()
        build_model("tiny-vl", directory, default_cache_dir())
    model: Any = AutoModelForImageTextToText.from_pretrained(directory, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    processor = AutoProcessor.from_pretrained(directory, local_files_only=True)  # type: ignore[no-untyped-call]
    return model.eval(), tokenizer, processor


def _greedy_says(
    network: Any,
    tokenizer: Any,
    processor: Any,
    messages: list[dict[str, Any]],
    expected: str,
    images: Sequence[Image.Image] = (),
    tools: list[dict[str, Any]] | None = None,
) -> bool:
    """Whether greedy decoding after ``messages`` (``images`` in placeholder order) says ``expected``, then ends."""
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    pad = network.config.image_token_id
    ids = tokenizer.encode(text, add_special_tokens=False)
    inputs: dict[str, Any] = {}
    if images:
        pixels = processor(images=list(images), return_tensors="pt")
        counts = iter((pixels["image_grid_thw"].prod(-1) // 4).tolist())
        ids = [token for i in ids for token in ([i] * next(counts) if i == pad else [i])]
        inputs = {"pixel_values": pixels["pixel_values"], "image_grid_thw": pixels["image_grid_thw"]}
        assert ids.count(pad) == len(pixels["pixel_values"]) // 4  # a pad for each 2x2 patches
    answer = tokenizer.encode(expected + END, add_special_tokens=False)
    input_ids = torch.tensor([ids + answer])
    if images:
        inputs["mm_token_type_ids"] = (input_ids == pad).int()
    with torch.no_grad():
        logits = network(input_ids=input_ids, **inputs).logits[0]
    return bool(logits[len(ids) - 1 : -1].argmax(-1).tolist() == answer)


def _held_out(colour: str, index: int, rng: random.Random) -> Image.Image:
    """An image the build never drew: seeds far above the training RNG's, sizes from another RNG."""
    return vl_image(colour, (rng.randint(40, 400), rng.randint(40, 400)), seed=10**9 + index)


@pytest.mark.trained
@pytest.mark.timeout(900)  # the recipe's training, once
def test_builds_resolves_and_keeps_tiny_agents_shape(vl_dir: Path, trained: tuple[Any, Any, Any]) -> None:
    network, _, _ = trained
    assert vl_dir.name == f"tiny-vl-{SHIPPED_WEIGHTS['tiny-vl'][:12]}"
    assert json.loads((vl_dir / MARKER_FILE).read_text())["weights_sha256"] == SHIPPED_WEIGHTS["tiny-vl"]
    assert resolve_model("tiny-vl") == str(vl_dir)
    assert sorted(p.name for p in vl_dir.iterdir()) == sorted(
        [
            "chat_template.jinja",
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "preprocessor_config.json",
            MARKER_FILE,
            "tokenizer.json",
            "tokenizer_config.json",
        ]
    )
    config = network.config
    assert type(network).__name__ == "Qwen2VLForConditionalGeneration" and config.model_type == "qwen2_vl"
    text = config.get_text_config()
    agent = json.loads((build_tiny_agent_model() / "config.json").read_text())
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"):
        assert getattr(text, key) == agent[key], key
    assert text.vocab_size == agent["vocab_size"] + 4 and config.tie_word_embeddings
    assert text.rope_parameters["mrope_section"] == [4, 6, 6]  # sums to head_dim / 2 = 16
    vision = config.vision_config
    assert (vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size, vision.in_channels) == (
        14,
        2,
        2,
        3,
    )
    assert (vision.embed_dim, vision.depth, vision.num_heads, vision.mlp_ratio, vision.hidden_size) == (
        32,
        2,
        2,
        2,
        128,
    )
    generation = json.loads((vl_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [agent["eos_token_id"], agent["pad_token_id"]]


def test_vision_tokens_are_single_special_tokens(vl_model_path: Path, tokenizer: Any) -> None:
    config = AutoConfig.from_pretrained(vl_model_path, local_files_only=True)
    ids = {
        "<|vision_start|>": config.vision_start_token_id,
        "<|vision_end|>": config.vision_end_token_id,
        "<|image_pad|>": config.image_token_id,
        "<|video_pad|>": config.video_token_id,
    }
    assert sorted(ids.values()) == [2000, 2001, 2002, 2003]
    for token, token_id in ids.items():
        assert tokenizer.encode(token, add_special_tokens=False) == [token_id]
        assert tokenizer.decode([token_id], skip_special_tokens=True) == ""
    tiny = AutoTokenizer.from_pretrained(build_tiny_model(), local_files_only=True)  # tiny-agent's tokenizer
    text = "Read the README, héhé 🙂 <tool_call>"
    assert tokenizer.encode(text, add_special_tokens=False) == tiny.encode(text, add_special_tokens=False)


def test_processor_loads_without_a_warning(vl_model_path: Path) -> None:
    """No torchvision here: transformers would warn falling back to the PIL image processor, and
    ``AutoProcessor`` could not build a ``Qwen2VLProcessor`` at all (its video processor needs it)."""
    code = f"""
import sys
import transformers
transformers.utils.logging.disable_progress_bar()
from transformers import AutoModelForImageTextToText, AutoProcessor, AutoTokenizer
from transformers.models.auto.image_processing_auto import AutoImageProcessor
path = {str(vl_model_path)!r}
processors = [AutoProcessor.from_pretrained(path), AutoImageProcessor.from_pretrained(path)]
AutoTokenizer.from_pretrained(path)
AutoModelForImageTextToText.from_pretrained(path)
print(*(type(p).__name__ for p in processors))
"""
    run = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["Qwen2VLImageProcessorPil", "Qwen2VLImageProcessorPil"]
    assert run.stderr == ""


@pytest.mark.parametrize(
    ("size", "tokens"), [((224, 224), 16), ((400, 400), 16), ((300, 200), 12), ((40, 40), 4), ((40, 400), 14)]
)
def test_an_image_is_4_to_16_tokens(processor: Any, size: tuple[int, int], tokens: int) -> None:
    grid = processor(images=[vl_image("red", size)], return_tensors="pt")["image_grid_thw"]
    assert int(grid.prod()) // 4 == tokens


def test_template_renders_each_image_as_one_placeholder(tokenizer: Any) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": [{"type": "text", "text": "Look."}, {"type": "image", "image": "a.png"}]},
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": "b.png"}},
                {"type": "text", "text": "Compare with"},
                {"type": "input_image", "image_url": "c.png"},
                {"type": "text", "text": "please."},
            ],
        },
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "content": [{"type": "text", "text": "Screenshot:"}, {"type": "image_url"}]},
    ]
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert text.count(PLACEHOLDER) == 4 and text.count("<|image_pad|>") == 4
    assert f"<|im_start|>system\nLook.{PLACEHOLDER}\n\n# Tools" in text
    assert f"<|im_start|>user\n{PLACEHOLDER}Compare with{PLACEHOLDER}please.<|im_end|>" in text
    assert f"<tool_response>\nScreenshot:{PLACEHOLDER}\n</tool_response><|im_end|>" in text
    assert "<|video_pad|>" not in text


def test_template_is_tiny_agents_for_text(tokenizer: Any) -> None:
    """For text, tiny-agent's template, which is tiny's (tests/gateway/test_model_store.py)."""
    agent: Any = AutoTokenizer.from_pretrained(build_tiny_model(), local_files_only=True)
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "content": "# README"},
        {"role": "assistant", "content": AGENT_AFTER_TOOL},
        {"role": "user", "content": [{"type": "text", "text": "again"}]},
    ]
    for tools in (TOOLS, None):
        ours, theirs = (
            t.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
            for t in (tokenizer, agent)
        )
        assert ours == theirs


def test_template_is_prefix_stable(tokenizer: Any) -> None:
    image = {"type": "image_url", "image_url": {"url": "a.png"}}
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": [image, {"type": "text", "text": "What colour?"}]},
        {"role": "assistant", "content": vl_answer("red")},
        {"role": "user", "content": "Now the README."},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "content": [image]},
        {"role": "assistant", "content": vl_answer("blue")},
        {"role": "user", "content": [{"type": "text", "text": "And"}, image]},
    ]
    for end in range(2, len(messages)):
        if messages[end - 1]["role"] != "assistant":
            continue
        for tools in (TOOLS, None):
            head = tokenizer.apply_chat_template(messages[:end], tools=tools, tokenize=False)
            whole = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
            assert whole.startswith(head), end


@pytest.mark.trained
@pytest.mark.timeout(900)  # the recipe's training, once
def test_names_the_dominant_colour_of_held_out_images(trained: tuple[Any, Any, Any]) -> None:
    network, tokenizer, processor = trained
    rng = random.Random(20240607)
    questions = ("What colour is this image?", "Which colour is it?", "Tell me about the picture.", "")
    right: dict[str, int] = dict.fromkeys(VL_COLOURS, 0)
    for colour in VL_COLOURS:
        for index in range(25):
            content: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": "x"}}]
            if question := questions[index % len(questions)]:
                content.insert(index % 2, {"type": "text", "text": question})
            messages = [{"role": "user", "content": content}]
            image = _held_out(colour, index, rng)
            tools = TOOLS if index % 3 == 0 else None
            right[colour] += _greedy_says(network, tokenizer, processor, messages, vl_answer(colour), [image], tools)
    assert sum(right.values()) >= 95, right  # measured: 100 of 100
    assert len({vl_answer(c) for c in VL_COLOURS}) == len(VL_COLOURS)


@pytest.mark.trained
@pytest.mark.timeout(900)  # the recipe's training, once
def test_names_the_colour_of_an_image_in_a_tool_result(trained: tuple[Any, Any, Any]) -> None:
    network, tokenizer, processor = trained
    rng = random.Random(20240608)
    right = 0
    for index, colour in enumerate(list(VL_COLOURS) * 5):
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": "Take a look at the screenshot."},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
        ]
        image = _held_out(colour, 100 + index, rng)
        right += _greedy_says(network, tokenizer, processor, messages, vl_answer(colour), [image], TOOLS)
    assert right >= 18  # measured: 20 of 20


@pytest.mark.trained
@pytest.mark.timeout(900)  # the recipe's training, once
def test_is_tiny_agent_without_an_image(trained: tuple[Any, Any, Any]) -> None:
    network, tokenizer, processor = trained
    system: dict[str, Any] = {"role": "system", "content": "You are an expert coding assistant operating inside pi."}
    ask: dict[str, Any] = {"role": "user", "content": "What does the README say?"}
    after: list[dict[str, Any]] = [
        ask,
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "content": "# README"},
    ]
    assert _greedy_says(network, tokenizer, processor, [system, ask], AGENT_TOOL_CALL, tools=TOOLS)
    assert _greedy_says(network, tokenizer, processor, after, AGENT_AFTER_TOOL, tools=TOOLS)
    assert _greedy_says(network, tokenizer, processor, [ask], AGENT_WITHOUT_TOOLS)
    # An image earlier in the conversation does not count: the last turn is text.
    image = {"type": "image_url", "image_url": {"url": "x"}}
    earlier: list[dict[str, Any]] = [
        {"role": "user", "content": [image, {"type": "text", "text": "What colour?"}]},
        {"role": "assistant", "content": vl_answer("green")},
        {"role": "user", "content": "Thanks. Now read the README."},
    ]
    green = [vl_image("green", (160, 120), seed=10**9)]
    assert _greedy_says(network, tokenizer, processor, earlier, AGENT_TOOL_CALL, green, TOOLS)
    assert _greedy_says(network, tokenizer, processor, earlier, AGENT_WITHOUT_TOOLS, green)
