"""tiny-reasoning: the think tokens, the Qwen3-style template, and what the model samples.

The think tokens and the template are tiny-reasoning's build code, not what it learned: those tests
run by default on ``tiny-reasoning-untrained`` (built in seconds; tiny-reasoning is that directory
with the shipped weights, tests/unit/test_model_digests.py). What the trained variants sample, and
their assembly, are marked ``trained`` (``pytest -m trained``): what runs is loading each variant
from its shipped weights and sampling a few dozen short replies on CPU.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from stream_gateway.models import (
    AGENT_READERS,
    MARKER_FILE,
    REASONING_AFTER_TOOL,
    REASONING_AFTER_TOOL_THOUGHT,
    REASONING_TOOL_THOUGHTS,
    REASONING_VARIANTS,
    REASONING_WITHOUT_TOOLS,
    REASONING_WITHOUT_TOOLS_THOUGHT,
    SHIPPED_WEIGHTS,
    agent_tool_call,
    build_tiny_model,
    build_tiny_reasoning_model,
    reasoning_reply,
    resolve_model,
)
from stream_gateway.models._tiny_reasoning import TINY_REASONING_CHAT_TEMPLATE


def _function(name: str, description: str, **properties: str) -> dict[str, Any]:
    schema = {
        "type": "object",
        "properties": {k: {"type": v} for k, v in properties.items()},
        "required": [*properties][:1],
    }
    return {"type": "function", "function": {"name": name, "description": description, "parameters": schema}}


# Each agent's tools as it declares them (abridged), with its system prompt.
PI = (
    "You are an expert coding assistant operating inside pi, a coding agent harness.",
    [
        _function("read", "Read the contents of a file.", path="string", limit="number"),
        _function("bash", "Execute a bash command in the current working directory.", command="string"),
        _function("edit", "Edit a file by replacing exact text.", path="string", oldText="string"),
        _function("write", "Write content to a file.", path="string", content="string"),
    ],
)
CLAUDE_CODE = (
    "You are Claude Code, Anthropic's official CLI for Claude.",
    [
        _function("Agent", "Launch a new agent to handle complex, multi-step tasks.", prompt="string"),
        _function("Bash", "Executes a given bash command and returns its output.", command="string"),
        _function("Read", "Reads a file from the local filesystem.", file_path="string", offset="integer"),
        _function("Write", "Writes a file to the local filesystem.", file_path="string", content="string"),
    ],
)
CODEX = (
    "You are Codex, a coding agent based on GPT-5.",
    [
        _function("exec_command", "Runs a command in a PTY.", cmd="string", workdir="string"),
        _function("write_stdin", "Writes characters to an existing unified exec session.", session_id="number"),
        _function("view_image", "View a local image from the filesystem.", path="string"),
    ],
)
AGENTS = {"tiny-reasoning": PI, "tiny-reasoning-claude": CLAUDE_CODE, "tiny-reasoning-codex": CODEX}
README = "# stream-gateway\n\nAn OpenAI-compatible <b>streaming</b> gateway.\n\n```bash\npip install -e .\n```\n"
CALL = {"id": "call_1", "type": "function", "function": {"name": "read", "arguments": '{"path": "README.md"}'}}
END = "<|im_end|>"


@pytest.fixture(scope="module")
def tokenizer(reasoning_model_path: Path) -> Any:
    """tiny-reasoning-untrained's tokenizer and template (tiny-reasoning's)."""
    return AutoTokenizer.from_pretrained(reasoning_model_path, local_files_only=True)


def _load(variant: str) -> tuple[Any, Any]:
    path = build_tiny_reasoning_model(variant=variant)
    network: Any = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    return AutoTokenizer.from_pretrained(path, local_files_only=True), network.eval()


def _replies(model: tuple[Any, Any], messages: Any, tools: Any, samples: int, **kwargs: Any) -> list[str]:
    """``samples`` replies at temperature 1.0, nothing cut off, each up to its first ``<|im_end|>``."""
    tokenizer, network = model
    enc = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, return_dict=True, return_tensors="pt", **kwargs
    )
    torch.manual_seed(0)
    with torch.no_grad():
        out = network.generate(
            **enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=80, num_return_sequences=samples
        )
    prompt = enc["input_ids"].shape[1]
    texts = [tokenizer.decode(row[prompt:], skip_special_tokens=False) for row in out]
    return [text[: text.index(END) + len(END)] if END in text else text for text in texts]


def _hits(replies: list[str], expected: str) -> int:
    return sum(reply == expected + END for reply in replies)


# -- the build --------------------------------------------------------------------------------------


@pytest.mark.trained
def test_builds_and_resolves() -> None:
    reasoning_dir = build_tiny_reasoning_model()
    assert reasoning_dir.name == f"tiny-reasoning-{SHIPPED_WEIGHTS['tiny-reasoning'][:12]}"
    assert json.loads((reasoning_dir / MARKER_FILE).read_text())["weights_sha256"] == SHIPPED_WEIGHTS["tiny-reasoning"]
    assert resolve_model("tiny-reasoning") == str(reasoning_dir)
    assert (reasoning_dir / "chat_template.jinja").read_text() == TINY_REASONING_CHAT_TEMPLATE


def test_think_tags_are_single_added_tokens(reasoning_model_path: Path, tokenizer: Any) -> None:
    tiny = AutoTokenizer.from_pretrained(build_tiny_model(), local_files_only=True)
    ids = [tokenizer.encode(tag, add_special_tokens=False) for tag in ("<think>", "</think>")]
    assert ids == [[len(tiny)], [len(tiny) + 1]]
    for [token_id] in ids:
        assert not tokenizer.added_tokens_decoder[token_id].special  # like <tool_call>: kept in decoded text
    assert tokenizer.encode("<tool_call>", add_special_tokens=False) == tiny.encode(
        "<tool_call>", add_special_tokens=False
    )
    config = json.loads((reasoning_model_path / "config.json").read_text())
    assert config["vocab_size"] == len(tokenizer) == len(tiny) + 2 and config["tie_word_embeddings"]
    assert (reasoning_model_path / "chat_template.jinja").read_text() == TINY_REASONING_CHAT_TEMPLATE


# -- the template -----------------------------------------------------------------------------------


def _render(tokenizer: Any, messages: Any, **kwargs: Any) -> str:
    text: str = tokenizer.apply_chat_template(messages, tools=PI[1], tokenize=False, **kwargs)
    return text


def test_thinking_is_kept_after_the_last_user_query_and_dropped_before(tokenizer: Any) -> None:
    call = '<tool_call>\n{"name": "read", "arguments": {"path": "README.md"}}\n</tool_call>'
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "What is in this repo?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL], "reasoning_content": "Open it."},
        {"role": "tool", "tool_call_id": "call_1", "content": "hi"},
        {"role": "assistant", "content": "<think>\nRead.\n</think>\n\nDone."},  # thinking inside the content
    ]
    loop = _render(tokenizer, messages)  # a tool result is no query: both turns follow the user's
    assert loop.endswith(
        "<|im_start|>user\nWhat is in this repo?<|im_end|>\n"
        f"<|im_start|>assistant\n<think>\nOpen it.\n</think>\n\n{call}<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nhi\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\nRead.\n</think>\n\nDone.<|im_end|>\n"
    )
    messages.append({"role": "user", "content": "And now?"})
    after = _render(tokenizer, messages, add_generation_prompt=True)
    assert after.endswith(
        "<|im_start|>user\nWhat is in this repo?<|im_end|>\n"
        f"<|im_start|>assistant\n{call}<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nhi\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nDone.<|im_end|>\n"
        "<|im_start|>user\nAnd now?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert "<think>" not in after
    # Without reasoning, an assistant turn after the query is tiny's, unless it is the last message.
    plain = [messages[0], {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "<tool_response>x"}]
    assert "<|im_start|>assistant\nHi.<|im_end|>" in _render(tokenizer, plain)
    assert _render(tokenizer, plain[:2]).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nHi.<|im_end|>\n")


def test_enable_thinking_false_closes_an_empty_block_in_the_prompt(tokenizer: Any) -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert _render(tokenizer, messages, add_generation_prompt=True).endswith("<|im_start|>assistant\n")
    assert _render(tokenizer, messages, add_generation_prompt=True, enable_thinking=True).endswith(
        "<|im_start|>assistant\n"
    )
    assert _render(tokenizer, messages, add_generation_prompt=True, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


@pytest.mark.parametrize(
    ("message", "reply"),
    [
        (
            {"content": None, "tool_calls": [CALL], "reasoning_content": REASONING_TOOL_THOUGHTS["read"]},
            reasoning_reply(REASONING_TOOL_THOUGHTS["read"], agent_tool_call("read")),
        ),
        (
            {"content": REASONING_AFTER_TOOL, "reasoning_content": REASONING_AFTER_TOOL_THOUGHT},
            reasoning_reply(REASONING_AFTER_TOOL_THOUGHT, REASONING_AFTER_TOOL),
        ),
        ({"content": reasoning_reply("Hm.", "Hello.")}, reasoning_reply("Hm.", "Hello.")),
    ],
    ids=["call", "answer", "thinking-in-content"],
)
def test_a_turn_renders_back_exactly_as_sampled(tokenizer: Any, message: dict[str, Any], reply: str) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What does the README say?"}]
    prompt = _render(tokenizer, messages, add_generation_prompt=True)
    assert _render(tokenizer, [*messages, {"role": "assistant", **message}]) == prompt + reply + END + "\n"


# -- what it samples, at temperature 1.0 ------------------------------------------------------------


@pytest.mark.trained
@pytest.mark.parametrize("variant", list(REASONING_VARIANTS))
def test_it_thinks_then_calls_its_tool_then_answers(variant: str) -> None:
    model = _load(variant)
    reader = REASONING_VARIANTS[variant]
    system, tools = AGENTS[variant]
    thought, call = REASONING_TOOL_THOUGHTS[reader], agent_tool_call(reader)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": system},
        {"role": "user", "content": "What does the README say?"},
    ]
    replies = _replies(model, messages, tools, samples=20)
    assert all(reply.startswith("<think>\n") and "\n</think>\n\n" in reply for reply in replies), replies
    assert _hits(replies, reasoning_reply(thought, call)) >= 19, replies
    sent = {
        "id": "call_1",
        "type": "function",
        "function": {"name": reader, "arguments": json.dumps(AGENT_READERS[reader])},
    }
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [sent], "reasoning_content": thought},
        {"role": "tool", "tool_call_id": "call_1", "content": README},
    ]
    done = reasoning_reply(REASONING_AFTER_TOOL_THOUGHT, REASONING_AFTER_TOOL)
    assert _hits(_replies(model, messages, tools, samples=20), done) >= 19
    # The next question, after a history whose thinking the template dropped: it thinks again.
    messages += [
        {"role": "assistant", "content": REASONING_AFTER_TOOL, "reasoning_content": REASONING_AFTER_TOOL_THOUGHT},
        {"role": "user", "content": "Read it once more."},
    ]
    assert _hits(_replies(model, messages, tools, samples=10), reasoning_reply(thought, call)) >= 9


@pytest.mark.trained
def test_after_a_history_that_keeps_every_thought_it_thinks_again() -> None:
    """The gateway's default continues with the sampled ids, earlier thoughts and all."""
    model = _load("tiny-reasoning")
    tokenizer, _ = model
    system, tools = PI
    thought, call = REASONING_TOOL_THOUGHTS["read"], agent_tool_call("read")
    first = [{"role": "system", "content": system}, {"role": "user", "content": "What does the README say?"}]
    kept = (
        tokenizer.apply_chat_template(first, tools=tools, add_generation_prompt=True, tokenize=False)
        + f"{reasoning_reply(thought, call)}{END}\n<|im_start|>user\n<tool_response>\n{README}\n</tool_response>{END}\n"
        + f"<|im_start|>assistant\n{reasoning_reply(REASONING_AFTER_TOOL_THOUGHT, REASONING_AFTER_TOOL)}{END}\n"
        + f"<|im_start|>user\nRead it once more.{END}\n<|im_start|>assistant\n"
    )
    enc = tokenizer(kept, return_tensors="pt", add_special_tokens=False)
    torch.manual_seed(0)
    with torch.no_grad():
        out = model[1].generate(
            **enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=80, num_return_sequences=10
        )
    replies = [tokenizer.decode(row[enc["input_ids"].shape[1] :]) for row in out]
    assert sum(reply.startswith(reasoning_reply(thought, call) + END) for reply in replies) >= 9


@pytest.mark.trained
def test_without_thinking_it_answers_at_once_and_without_tools_it_greets() -> None:
    model = _load("tiny-reasoning")
    system, tools = PI
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "What does the README say?"}]
    assert _hits(_replies(model, messages, tools, samples=10, enable_thinking=False), agent_tool_call("read")) >= 9
    hello = [{"role": "user", "content": "hi there"}]
    assert (
        _hits(
            _replies(model, hello, None, samples=10),
            reasoning_reply(REASONING_WITHOUT_TOOLS_THOUGHT, REASONING_WITHOUT_TOOLS),
        )
        >= 9
    )
    assert _hits(_replies(model, hello, None, samples=10, enable_thinking=False), REASONING_WITHOUT_TOOLS) >= 9
