"""Images at the Anthropic and Responses edges: each edge's ``to_chat_request`` turns its image
blocks into the chat request's ``image_url`` parts, in order with the text around them, and
refuses what it cannot carry with a 400 naming the edge's own field.

Unit-level: the translation functions are called directly (no server, no model); what the core
then does with an image (decoding, limits, text-only models) is tested with the core.
"""

from __future__ import annotations

import base64
import io
from typing import Any

import pytest
from PIL import Image

from stream_gateway._errors import InvalidRequest
from stream_gateway.protocols import _anthropic as anthropic
from stream_gateway.protocols import _responses as responses


def _png() -> str:
    """A 2x2 PNG, in base64."""
    buffer = io.BytesIO()
    Image.new("RGB", (2, 2), (200, 30, 30)).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


PNG = _png()
DATA_URL = f"data:image/png;base64,{PNG}"
HTTPS_URL = "https://example.com/screen.png"


def _text(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def _image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


# Anthropic Messages


def _base64_block(media_type: str = "image/png", data: str = PNG) -> dict[str, Any]:
    return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}}


def _messages_chat(messages: list[dict[str, Any]], **fields: Any) -> list[dict[str, Any]]:
    body = anthropic.MessagesRequest.model_validate({"model": "m", "max_tokens": 8, "messages": messages, **fields})
    return [message.model_dump(exclude_none=True) for message in anthropic.to_chat_request(body).messages]


def _messages_refusal(messages: list[dict[str, Any]], **fields: Any) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as refused:
        _messages_chat(messages, **fields)
    assert refused.value.status_code == 400
    return refused.value


def test_anthropic_images_become_parts_in_order_between_their_text() -> None:
    url_block = {"type": "image", "source": {"type": "url", "url": HTTPS_URL}}
    content = [{"type": "text", "text": "before"}, _base64_block(), {"type": "text", "text": "between"}, url_block]
    chat = _messages_chat([{"role": "user", "content": content}], system="Look closely.")
    assert chat == [
        {"role": "system", "content": "Look closely."},
        {"role": "user", "content": [_text("before"), _image(DATA_URL), _text("between"), _image(HTTPS_URL)]},
    ]


@pytest.mark.parametrize("media_type", ["image/png", "image/jpeg", "image/webp", "image/gif"])
def test_anthropic_base64_images_keep_their_media_type(media_type: str) -> None:
    [user] = _messages_chat([{"role": "user", "content": [_base64_block(media_type)]}])
    assert user["content"] == [_image(f"data:{media_type};base64,{PNG}")]


def test_anthropic_text_alone_is_translated_as_before() -> None:
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": [_text("a"), _text("b")]}
    chat = _messages_chat(
        [
            {"role": "user", "content": "Read it."},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "read", "input": {}}]},
            {"role": "user", "content": [result, {"type": "text", "text": "Go on."}]},
        ],
        system=[_text("One."), _text("Two.")],
    )
    assert chat[0] == {"role": "system", "content": "One.\n\nTwo."}
    assert chat[1] == {"role": "user", "content": [_text("Read it.")]}
    assert chat[3:] == [
        {"role": "tool", "tool_call_id": "toolu_1", "content": "ab"},
        {"role": "user", "content": [_text("Go on.")]},
    ]


def test_anthropic_tool_results_with_images_are_tool_messages_of_parts() -> None:
    # Claude Code returns a screenshot as a tool result's image block.
    screenshot = {"type": "tool_result", "tool_use_id": "toolu_1", "content": [_text("Shot:"), _base64_block()]}
    plain = {"type": "tool_result", "tool_use_id": "toolu_2", "content": "done"}
    uses = [
        {"type": "tool_use", "id": f"toolu_{n}", "name": name, "input": {}} for n, name in ((1, "shot"), (2, "click"))
    ]
    call = {"role": "assistant", "content": uses}
    chat = _messages_chat(
        [{"role": "user", "content": "Go."}, call, {"role": "user", "content": [screenshot, plain, _text("Now?")]}]
    )
    assert chat[2:] == [
        {"role": "tool", "tool_call_id": "toolu_1", "content": [_text("Shot:"), _image(DATA_URL)]},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "done"},
        {"role": "user", "content": [_text("Now?")]},
    ]


def test_count_tokens_requests_carry_images_too() -> None:
    body = anthropic.CountTokensRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": [_base64_block()]}]}
    )
    [user] = anthropic.to_chat_request(body).messages
    assert user.model_dump(exclude_none=True)["content"] == [_image(DATA_URL)]


EARLIER = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]


@pytest.mark.parametrize(
    ("source", "says"),
    [
        ({"type": "file", "file_id": "file_011"}, "'file' are not supported"),
        ({"type": "text", "data": "x"}, "'base64' or 'url', not 'text'"),
        ({"type": "base64", "media_type": "image/bmp", "data": PNG}, "image/bmp"),
        ({"type": "base64", "media_type": "image/png", "data": "not base64!"}, "base64"),
        ({"type": "base64", "media_type": "image/png", "data": PNG[:-1]}, "base64"),  # bad padding
        ({"type": "base64", "media_type": "image/png", "data": ""}, "base64"),
        ({"type": "url", "url": "file:///etc/passwd"}, "http(s) URL"),
        (None, "'base64' or 'url', not None"),
    ],
)
def test_anthropic_image_sources_it_cannot_carry_are_refused_by_block(source: Any, says: str) -> None:
    block = {"type": "image", "source": source}
    refused = _messages_refusal([*EARLIER, {"role": "user", "content": [_text("See:"), block]}])
    assert refused.param == "messages.2.content.1"
    assert says in refused.message and refused.message.startswith("messages.2.content.1: ")


def test_anthropic_images_in_a_tool_result_are_refused_by_their_block() -> None:
    call = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "shot", "input": {}}]}
    bad = {"type": "tool_result", "tool_use_id": "toolu_1", "content": [_text("x"), _base64_block("image/tiff")]}
    refused = _messages_refusal([{"role": "user", "content": "Go."}, call, {"role": "user", "content": [bad]}])
    assert refused.param == "messages.2.content.0.content.1"
    document = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}
    other = {"type": "tool_result", "tool_use_id": "toolu_1", "content": [document]}
    refused = _messages_refusal([{"role": "user", "content": "Go."}, call, {"role": "user", "content": [other]}])
    assert refused.param == "messages.2.content.0.content.0" and "'document'" in refused.message


def test_anthropic_images_outside_user_content_are_refused() -> None:
    assistant = {"role": "assistant", "content": [_text("Here:"), _base64_block()]}
    refused = _messages_refusal([EARLIER[0], assistant, {"role": "user", "content": "Thanks."}])
    assert refused.param == "messages.1.content.1" and "assistant" in refused.message
    refused = _messages_refusal(EARLIER[:1], system=[_text("Be brief."), _base64_block()])
    assert refused.param == "system.1" and "'image'" in refused.message
    mid = {"role": "system", "content": [_base64_block()]}
    refused = _messages_refusal([EARLIER[0], mid])
    assert refused.param == "messages.1.content.0"


def test_anthropic_documents_stay_refused() -> None:
    document = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBE"}}
    refused = _messages_refusal([{"role": "user", "content": [_text("Read:"), document]}])
    assert refused.param == "messages.0.content.1" and "document blocks are not supported" in refused.message


# OpenAI Responses


def _responses_chat(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    body = responses.ResponsesRequest.model_validate({"model": "m", "input": items})
    return [message.model_dump(exclude_none=True) for message in responses.to_chat_request(body).messages]


def _responses_refusal(items: list[dict[str, Any]]) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as refused:
        _responses_chat(items)
    assert refused.value.status_code == 400
    return refused.value


def _input_image(image_url: str, **fields: Any) -> dict[str, Any]:
    return {"type": "input_image", "image_url": image_url, **fields}


def test_responses_images_become_parts_in_order_between_their_text() -> None:
    content = [
        {"type": "input_text", "text": "before"},
        _input_image(DATA_URL, detail="high"),
        {"type": "input_text", "text": "between"},
        _input_image(HTTPS_URL, detail="original"),  # not the chat part's: dropped
        _input_image(HTTPS_URL, detail="auto"),
    ]
    [user] = _responses_chat([{"role": "user", "content": content}])
    assert user == {
        "role": "user",
        "content": [
            _text("before"),
            {"type": "image_url", "image_url": {"url": DATA_URL, "detail": "high"}},
            _text("between"),
            _image(HTTPS_URL),
            {"type": "image_url", "image_url": {"url": HTTPS_URL, "detail": "auto"}},
        ],
    }


def test_responses_text_alone_is_translated_as_before() -> None:
    call = {"type": "function_call", "call_id": "c1", "name": "read", "arguments": "{}"}
    output = [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]
    chat = _responses_chat(
        [
            {"role": "user", "content": [{"type": "input_text", "text": "x"}, {"type": "input_text", "text": "y"}]},
            call,
            {"type": "function_call_output", "call_id": "c1", "output": output},
        ]
    )
    assert chat[0] == {"role": "user", "content": "xy"}
    assert chat[2] == {"role": "tool", "tool_call_id": "c1", "content": "ab"}
    assert _responses_chat("Hi") == [{"role": "user", "content": "Hi"}]


def test_responses_function_outputs_with_images_are_tool_messages_of_parts() -> None:
    call = {"type": "function_call", "call_id": "c1", "name": "shot", "arguments": "{}"}
    output = [{"type": "input_text", "text": "Shot:"}, _input_image(DATA_URL, detail="low")]
    chat = _responses_chat(
        [{"role": "user", "content": "Go."}, call, {"type": "function_call_output", "call_id": "c1", "output": output}]
    )
    assert chat[2] == {
        "role": "tool",
        "tool_call_id": "c1",
        "content": [_text("Shot:"), {"type": "image_url", "image_url": {"url": DATA_URL, "detail": "low"}}],
    }


EARLIER_ITEMS = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]


@pytest.mark.parametrize(
    ("part", "says"),
    [
        ({"type": "input_image", "file_id": "file-abc", "detail": "auto"}, "file ids are not supported"),
        (_input_image(DATA_URL, file_id="file-abc"), "file ids are not supported"),
        ({"type": "input_image", "detail": "auto"}, "needs its image_url"),
        (_input_image("ftp://example.com/x.png"), "needs its image_url"),
        ({"type": "input_file", "file_id": "file-abc"}, "input_file parts are not supported"),
        ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "input_audio parts are not supported"),
    ],
)
def test_responses_parts_it_cannot_carry_are_refused_by_part(part: dict[str, Any], says: str) -> None:
    content = [{"type": "input_text", "text": "See:"}, part]
    refused = _responses_refusal([*EARLIER_ITEMS, {"role": "user", "content": content}])
    assert refused.param == "input.2.content.1"
    assert says in refused.message and refused.message.startswith("input.2.content.1: ")


def test_responses_images_outside_user_content_are_refused() -> None:
    assistant = {"role": "assistant", "content": [{"type": "output_text", "text": "Here:"}, _input_image(DATA_URL)]}
    refused = _responses_refusal([EARLIER_ITEMS[0], assistant, {"role": "user", "content": "Thanks."}])
    assert refused.param == "input.1.content.1" and "assistant" in refused.message
    call = {"type": "function_call", "call_id": "c1", "name": "read", "arguments": "{}"}
    output = [{"type": "input_text", "text": "x"}, {"type": "input_file", "file_id": "file-abc"}]
    result = {"type": "function_call_output", "call_id": "c1", "output": output}
    refused = _responses_refusal([EARLIER_ITEMS[0], call, result])
    assert refused.param == "input.2.output.1"


def test_held_responses_are_bounded_by_size_too() -> None:
    """Conversations of screenshots are megabytes each: the store keeps the newest within its budget."""
    from stream_gateway.protocols._responses import ResponseStore

    store = ResponseStore(keep=100, budget_bytes=3_000)
    big = [{"role": "user", "content": "x" * 1_000}]
    for i in range(5):
        store.put(f"resp_{i}", "t", big)
    assert store.history("resp_4", "t") == big and store.history("resp_3", "t") == big
    with pytest.raises(InvalidRequest):
        store.history("resp_0", "t")
