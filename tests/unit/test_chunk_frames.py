"""The chat chunk encoder's plain-content frames: the bytes its general path writes, built without it."""

from __future__ import annotations

import orjson
import pytest

from stream_gateway.completion import ChoiceUpdate
from stream_gateway.protocols._chat import ChunkEncoder
from stream_gateway.tool_parsers import ToolCallDelta

TEXTS = ["a", " the", '"quoted"\\', "line\nbreak\t", "é中文🙂", "\u2028\x00"]


def _encoder(**options: bool) -> ChunkEncoder:
    return ChunkEncoder("chatcmpl-1", 1700000000, "tiny", token_text=lambda i: ("x", [120]), **options)


@pytest.mark.parametrize("text", TEXTS)
def test_a_plain_content_frame_is_what_the_general_path_writes(text: str) -> None:
    encoder = _encoder(logprobs=False, token_ids=False)
    frame = encoder.update(ChoiceUpdate(0, text, [5], [-0.5], None))
    general = encoder._frame([{"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}])
    assert frame == general
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
    chunk = orjson.loads(frame[6:])
    assert chunk["choices"] == [{"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}]
    assert (chunk["id"], chunk["object"], chunk["model"]) == ("chatcmpl-1", "chat.completion.chunk", "tiny")


def test_frames_with_more_than_content_keep_what_they_carry() -> None:
    plain = _encoder(logprobs=False, token_ids=False)
    finished = orjson.loads(plain.update(ChoiceUpdate(0, "end", [5], [-0.5], None, "stop"))[6:])
    assert finished["choices"][0]["finish_reason"] == "stop"
    second = orjson.loads(plain.update(ChoiceUpdate(1, "b", [5], [-0.5], None))[6:])
    assert second["choices"][0]["index"] == 1
    thought = orjson.loads(plain.update(ChoiceUpdate(0, "a", [5], [-0.5], None, reasoning="hm"))[6:])
    assert thought["choices"][0]["delta"]["reasoning_content"] == "hm"
    call = ToolCallDelta(0, "call_1", "read", "{}")
    called = orjson.loads(plain.update(ChoiceUpdate(0, "a", [5], [-0.5], None, tool_calls=(call,)))[6:])
    assert called["choices"][0]["delta"]["tool_calls"][0]["function"]["name"] == "read"
    update = ChoiceUpdate(0, "a", [5], [-0.5], None)
    ids = orjson.loads(_encoder(logprobs=False, token_ids=True).update(update)[6:])
    assert ids["choices"][0]["token_ids"] == [5]
    logprobs = orjson.loads(_encoder(logprobs=True, token_ids=False).update(update)[6:])
    assert logprobs["choices"][0]["logprobs"]["content"][0]["logprob"] == -0.5
