"""The ``scripted`` engine through a real gateway: answers by rules, logprobs by the model.

The default script is tiny-agent's repertoire on the untrained ``tiny`` (and the untrained
reasoning and vision variants): a tool call to whichever reading tool is offered, streamed as
OpenAI ``tool_calls``; "done" after the tool's result; hello otherwise; a thought first on a model
that thinks; an image's colour. Every answer's logprobs equal a forward pass of the same weights
over prompt and answer; a grammar refuses a script that breaks it; a user's script file is read by
``--script`` and a bad one is refused by name.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from openai import OpenAI
from transformers import AutoModelForCausalLM, AutoTokenizer

from stream_gateway import Settings
from stream_gateway.engines import build_engine
from stream_gateway.engines.scripted import DEFAULT_SCRIPT, Script, load_script
from stream_gateway.models import resolve_model, vl_image

from ..support.agent_loop import BASH_TOOL, READ_TOOL
from ..support.fidelity import assert_chain_logprobs
from ..support.servers import RunningGateway, run_gateway

CLAUDE_READ = {"type": "function", "function": {"name": "Read", "parameters": {"type": "object"}}}


def _serve(model: str, name: str, **options: object) -> Iterator[RunningGateway]:
    settings = Settings(model=model, served_model_name=name, engine="scripted", **options)
    with run_gateway(build_engine(settings), settings) as running:
        yield running


@pytest.fixture(scope="module")
def scripted(tiny_model_path: Path) -> Iterator[RunningGateway]:
    yield from _serve(str(tiny_model_path), "tiny-agent")


@pytest.fixture
def client(scripted: RunningGateway) -> Iterator[OpenAI]:
    with OpenAI(base_url=scripted.base_url + "/v1", api_key="sk-test", timeout=60, max_retries=0) as c:
        yield c


def test_the_default_script_is_tiny_agents_repertoire(client: OpenAI) -> None:
    hello = client.chat.completions.create(model="tiny-agent", messages=[{"role": "user", "content": "hi"}])
    assert hello.choices[0].message.content == "Hello from tiny-agent."
    assert hello.choices[0].finish_reason == "stop"

    for tools, name, arguments in (
        ([BASH_TOOL, READ_TOOL], "read", {"path": "README.md"}),
        ([CLAUDE_READ], "Read", {"file_path": "README.md"}),
    ):
        stream = client.chat.completions.create(
            model="tiny-agent", messages=[{"role": "user", "content": "what is here?"}], tools=tools, stream=True
        )
        calls: dict[int, dict[str, str]] = {}
        finish = None
        for chunk in stream:
            for choice in chunk.choices:
                finish = choice.finish_reason or finish
                for delta in choice.delta.tool_calls or []:
                    call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                    call["id"] += delta.id or ""
                    call["name"] += (delta.function and delta.function.name) or ""
                    call["arguments"] += (delta.function and delta.function.arguments) or ""
        assert finish == "tool_calls"
        [call] = calls.values()
        assert call["id"] and call["name"] == name and json.loads(call["arguments"]) == arguments

    done = client.chat.completions.create(
        model="tiny-agent",
        tools=[READ_TOOL],  # type: ignore[list-item]
        messages=[
            {"role": "user", "content": "read it"},
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "read", "arguments": '{"path": "README.md"}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "# A project"},
        ],
    )
    assert done.choices[0].message.content == "Done: I read the file."


def test_its_logprobs_are_a_forward_pass_of_the_model(client: OpenAI, tiny_model_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    for temperature in (1.0, 0.7):
        answer = client.chat.completions.create(
            model="tiny-agent",
            messages=[{"role": "user", "content": "hi"}],
            temperature=temperature,
            logprobs=True,
            extra_body={"return_token_ids": True},
        )
        extra = answer.model_extra or {}
        choice = answer.choices[0]
        prompt = extra["prompt_token_ids"]
        sampled = (choice.model_extra or {})["token_ids"]
        assert tokenizer.decode(sampled) == "Hello from tiny-agent.<|im_end|>"
        assert choice.logprobs is not None and choice.logprobs.content is not None
        logprobs = [entry.logprob for entry in choice.logprobs.content]
        assert len(logprobs) == len(sampled)
        mask = [0] * len(prompt) + [1] * len(sampled)
        assert_chain_logprobs(model, prompt + sampled, mask, [0.0] * len(prompt) + logprobs, temperature=temperature)


def test_a_grammar_refuses_a_script_that_breaks_it(client: OpenAI) -> None:
    """The script says hello; json_object's grammar masks it, and the model writes JSON instead."""
    answer = client.chat.completions.create(
        model="tiny-agent",
        messages=[{"role": "user", "content": "hi"}],
        response_format={"type": "json_object"},
        max_tokens=64,
        temperature=0.0,
    )
    text = answer.choices[0].message.content or ""
    assert not text.startswith("Hello")
    if answer.choices[0].finish_reason == "stop":
        json.loads(text)


def test_max_tokens_and_n_apply_to_a_script(client: OpenAI) -> None:
    answer = client.chat.completions.create(
        model="tiny-agent", messages=[{"role": "user", "content": "hi"}], max_tokens=2, n=2
    )
    assert [c.finish_reason for c in answer.choices] == ["length", "length"]
    assert answer.choices[0].message.content == answer.choices[1].message.content
    assert "Hello from tiny-agent.".startswith(answer.choices[0].message.content or "-")


def test_a_thinking_model_thinks_first() -> None:
    for running in _serve(resolve_model("tiny-reasoning-untrained"), "tiny-reasoning"):
        with OpenAI(base_url=running.base_url + "/v1", api_key="sk", max_retries=0) as client:
            answer = client.chat.completions.create(
                model="tiny-reasoning", messages=[{"role": "user", "content": "hi"}]
            )
            message = answer.choices[0].message
            assert message.content == "Hello from tiny-reasoning."
            assert (message.model_extra or {}).get("reasoning_content") == "No tools; say hi."
            plain = client.chat.completions.create(
                model="tiny-reasoning",
                messages=[{"role": "user", "content": "hi"}],
                extra_body={"chat_template_kwargs": {"enable_thinking": False}},
            )
            assert plain.choices[0].message.content == "Hello from tiny-reasoning."
            assert not (plain.choices[0].message.model_extra or {}).get("reasoning_content")


def test_a_model_that_sees_names_the_images_colour() -> None:
    for running in _serve(resolve_model("tiny-vl-untrained"), "tiny-vl"):
        with OpenAI(base_url=running.base_url + "/v1", api_key="sk", max_retries=0) as client:
            for colour in ("red", "blue", "yellow"):
                import io

                buffer = io.BytesIO()
                vl_image(colour, (120, 90), seed=7).save(buffer, format="PNG")
                url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
                answer = client.chat.completions.create(
                    model="tiny-vl",
                    messages=[
                        {
                            "role": "user",
                            "content": [
                                {"type": "text", "text": "What colour?"},
                                {"type": "image_url", "image_url": {"url": url}},
                            ],
                        }
                    ],
                )
                assert answer.choices[0].message.content == f"The image is {colour}."


def test_a_users_script_file_drives_the_engine(tmp_path: Path, tiny_model_path: Path) -> None:
    script = {
        "rules": [
            {"when": {"contains": "weather"}, "call": [{"name": "forecast", "arguments": {"city": "Paris"}}]},
            {"when": {"matches": "(?i)capital of france"}, "say": "Paris."},
            {"say": "I only know two things."},
        ]
    }
    path = tmp_path / "script.json"
    path.write_text(json.dumps(script))
    assert load_script(path) == Script.model_validate(script)
    for running in _serve(str(tiny_model_path), "demo", script=path):
        with OpenAI(base_url=running.base_url + "/v1", api_key="sk", max_retries=0) as client:

            def ask(text: str) -> str:
                answer = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": text}])
                return answer.choices[0].message.content or ""

            assert ask("What is the capital of France?") == "Paris."
            assert ask("hello") == "I only know two things."
            forecast = {"type": "function", "function": {"name": "forecast", "parameters": {"type": "object"}}}
            call = client.chat.completions.create(
                model="demo",
                messages=[{"role": "user", "content": "weather?"}],
                tools=[forecast],  # type: ignore[list-item]
            ).choices[0].message
            assert call.tool_calls and call.tool_calls[0].function.name == "forecast"  # type: ignore[union-attr]


def test_a_bad_script_is_refused_by_name(tmp_path: Path, tiny_model_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{"rules": [{"when": {"role": "user"}, "say": "x"}]}')
    with pytest.raises(SystemExit, match="bad.json is not a script"):
        build_engine(Settings(model=str(tiny_model_path), engine="scripted", script=path))
    with pytest.raises(SystemExit, match="--script"):
        build_engine(Settings(model=str(tiny_model_path), engine="transformers", script=path))
    assert DEFAULT_SCRIPT.rules, "the default script answers something"
