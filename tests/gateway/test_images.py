"""Images on a vision-language model: processed once, laid into the prompt exactly, recorded,
continued, refused clearly (docs/images.md).

The model is ``tiny-vl-untrained`` (tiny-vl's tokenizer, template, image processor and
architecture, untrained) on the scripted engine, served as ``tiny-vl``: it names the dominant
colour of the last image it was given (:func:`vl_answer`), calls ``read`` when it is offered, and
its logprobs are the untrained model's own.

Fidelity is checked against the Hugging Face model itself (:func:`tests.support.vision.forward_logprobs`):
the recorded ids and the original image bytes, processed again, through a plain forward pass.
"""

from __future__ import annotations

import base64
import http.server
import io
import itertools
import secrets
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import torch
from openai import OpenAI
from PIL import Image
from transformers import AutoModelForImageTextToText

from pipeline.vision import ImageLimits, VisionProcessor, image_digest
from stream_gateway import Settings
from stream_gateway.engines import build_engine
from stream_gateway.models import VL_COLOURS, vl_answer, vl_image

from ..support.servers import RunningGateway, run_gateway, scripted_settings
from ..support.vision import data_url, encode, forward_logprobs, image_part, noise, solid

MODEL = "tiny-vl"
KEY = "sk-vision"
HEADERS = {"authorization": f"Bearer {KEY}"}
RED, BLUE = solid((230, 20, 20)), solid((20, 20, 230), (64, 120))


@pytest.fixture(scope="module")
def image_server() -> Iterator[str]:
    """A loopback HTTP server with ``/red.png`` (and 404 for anything else)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path != "/red.png":
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("content-type", "image/png")
            self.send_header("content-length", str(len(RED)))
            self.end_headers()
            self.wfile.write(RED)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def vl_gateway(vl_model_path: Path) -> Iterator[RunningGateway]:
    settings = scripted_settings(
        vl_model_path,
        served_model_name=MODEL,
        max_batch_size=8,
        max_images_per_request=3,
        max_image_bytes=200_000,
        max_image_pixels=4_000_000,
        allow_image_urls=("127.0.0.1",),
    )
    with run_gateway(build_engine(settings), settings) as running:
        yield running


@pytest.fixture(scope="module")
def reference(vl_model_path: Path) -> Any:
    return AutoModelForImageTextToText.from_pretrained(vl_model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def processor(vl_gateway: RunningGateway) -> VisionProcessor:
    vision = vl_gateway.engine.vision
    assert vision is not None
    return vision


def _client(gateway: RunningGateway, session: str | None = None) -> OpenAI:
    base = f"{gateway.base_url}/sessions/{session}/v1" if session else f"{gateway.base_url}/v1"
    return OpenAI(base_url=base, api_key=KEY, max_retries=0)


def _session(gateway: RunningGateway, session: str) -> dict[str, Any]:
    response = httpx.get(f"{gateway.base_url}/sessions/{session}", headers=HEADERS, timeout=30)
    response.raise_for_status()
    body: dict[str, Any] = response.json()
    return body


def test_recorded_turns_equal_a_forward_pass_over_their_ids_and_images(
    vl_gateway: RunningGateway, reference: Any, processor: VisionProcessor
) -> None:
    """A user image, a tool call, then a second image in the tool result: every logprob is the
    model's own over the recorded ids with the images processed again; each turn continues the one
    before with its image tokens as recorded (not expanded again)."""
    session = f"vl{secrets.token_hex(4)}"
    path = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
    read = {"type": "function", "function": {"name": "read", "parameters": path}}
    with _client(vl_gateway, session) as client:
        messages: list[Any] = [{"role": "user", "content": [image_part(RED), {"type": "text", "text": "Colour?"}]}]
        answer = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            tools=[read],  # type: ignore[list-item]
            max_tokens=12,
            temperature=1.0,
        )
        assert answer.choices[0].message.content == vl_answer("red")
        messages += [
            {"role": "assistant", "content": answer.choices[0].message.content},
            {"role": "user", "content": "What is in the README?"},
        ]
        call = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            tools=[read],  # type: ignore[list-item]
            max_tokens=60,
            temperature=1.0,
        ).choices[0]
        assert call.finish_reason == "tool_calls", call
        assert [c.function.name for c in call.message.tool_calls or []] == ["read"]
        messages += [
            call.message.model_dump(exclude_none=True),
            {
                "role": "tool",
                "tool_call_id": call.message.tool_calls[0].id,  # type: ignore[index]
                "content": [{"type": "text", "text": "screenshot:"}, image_part(BLUE)],
            },
        ]
        last = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            tools=[read],  # type: ignore[list-item]
            max_tokens=12,
            temperature=1.0,
        )
        assert last.choices[0].message.content == vl_answer("blue")  # the image in the tool's result
    turns = _session(vl_gateway, session)["turns"]
    assert len(turns) == 3
    for parent, child in itertools.pairwise(turns):
        assert child["parent_id"] == parent["turn_id"], child["fallback_reason"]
        assert child["reused_prompt_tokens"] == len(parent["prompt_ids"]) + len(parent["output_ids"])
    red, blue = image_digest(RED), image_digest(BLUE)
    assert [[i["sha256"] for i in t["images"]] for t in turns] == [[red], [red], [red, blue]]
    assert turns[2]["images"][0] == turns[1]["images"][0] == turns[0]["images"][0]  # same tokens, same place
    for turn, sent in zip(turns, ([RED], [RED], [RED, BLUE]), strict=True):
        prompt = turn["prompt_ids"]
        for record, data in zip(turn["images"], sent, strict=True):
            expected = processor.process(data, ImageLimits())
            assert record["pixels_sha256"] == expected.pixels_sha256
            assert record["tokens"] == expected.tokens == expected.grid_thw[1] * expected.grid_thw[2] // 4
            run = prompt[record["start"] : record["start"] + record["tokens"]]
            assert run == [processor.token_id] * record["tokens"]
        assert prompt.count(processor.token_id) == sum(r["tokens"] for r in turn["images"])
        ids = prompt + turn["output_ids"]
        again = forward_logprobs(reference, processor, ids, sent, len(prompt))
        assert again == pytest.approx(turn["logprobs"], abs=1e-4)


def test_another_image_is_another_prompt(vl_gateway: RunningGateway) -> None:
    """The same words with a different image do not continue the recorded turn."""
    session = f"vl{secrets.token_hex(4)}"
    with _client(vl_gateway, session) as client:
        ask = {"type": "text", "text": "Colour?"}
        answer = (
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": [image_part(RED), ask]}], max_tokens=6
            )
            .choices[0]
            .message
        )
        follow = [{"role": "assistant", "content": answer.content}, {"role": "user", "content": "Sure?"}]
        for image in (RED, BLUE):  # the conversation echoed, then with its image swapped
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": [image_part(image), ask]}, *follow], max_tokens=6
            )
    turns = _session(vl_gateway, session)["turns"]
    assert [t["parent_id"] for t in turns] == [None, turns[0]["turn_id"], None]
    assert turns[2]["images"][0]["sha256"] == image_digest(BLUE)


def test_an_allowed_image_url_is_fetched_and_recorded_as_its_bytes(
    vl_gateway: RunningGateway, image_server: str
) -> None:
    session = f"vl{secrets.token_hex(4)}"
    with _client(vl_gateway, session) as client:
        part = {"type": "image_url", "image_url": {"url": f"{image_server}/red.png"}}
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [part]}], max_tokens=4)
        with pytest.raises(openai.BadRequestError, match="HTTP 404") as missing:
            part = {"type": "image_url", "image_url": {"url": f"{image_server}/nothing.png"}}
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [part]}], max_tokens=4)
        assert missing.value.body["param"] == "messages[0].content[0]"  # type: ignore[index]
    (turn,) = _session(vl_gateway, session)["turns"]
    assert turn["images"][0]["sha256"] == image_digest(RED)


def _bomb() -> bytes:
    """A 3000 x 3000 PNG of one colour: a few kilobytes on the wire, 9 megapixels decoded."""
    return encode(Image.new("RGB", (3000, 3000), (1, 2, 3)))


def _truncated() -> bytes:
    data = noise((64, 64))
    return data[: len(data) // 2]


BAD_IMAGES = {
    "too many bytes": ([image_part(noise((300, 300)))], "over 200000 bytes", "messages[0].content[0]"),
    "too many pixels": ([image_part(_bomb())], "at most 4000000 are accepted", "messages[0].content[0]"),
    "corrupt": ([image_part(_truncated())], "cannot be decoded", "messages[0].content[0]"),
    "bmp": ([image_part(solid((9, 9, 9), fmt="BMP"), "image/bmp")], "not a PNG, JPEG, WebP or GIF", None),
    "not base64": ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}}], "not valid base64", None),
    "not an image type": ([{"type": "image_url", "image_url": {"url": "data:text/plain;base64,aGk="}}], "image/", None),
    "too many images": ([image_part(RED)] * 4, "at most 3", None),
    "url not allowed": (
        [{"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}],
        "--allow-image-url",
        None,
    ),
    "ftp url": ([{"type": "image_url", "image_url": {"url": "ftp://127.0.0.1/a.png"}}], "data: URL or http", None),
}


@pytest.mark.parametrize("case", sorted(BAD_IMAGES))
def test_bad_images_get_a_400_naming_the_part(vl_gateway: RunningGateway, case: str) -> None:
    parts, message, param = BAD_IMAGES[case]
    content = [{"type": "text", "text": "look"}, *parts]
    with _client(vl_gateway) as client, pytest.raises(openai.BadRequestError, match=message) as refused:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "system", "content": "hi"}, {"role": "user", "content": content}]
        )
    body = refused.value.body
    assert isinstance(body, dict) and body["type"] == "invalid_request_error"
    assert body["param"] == (param or "messages[1].content[1]").replace("messages[0]", "messages[1]").replace(
        "content[0]", "content[1]"
    )
    assert vl_gateway.health()["status"] == "ok"


def test_images_for_a_text_only_model_are_refused(gateway: RunningGateway) -> None:
    content = [{"type": "text", "text": "a"}, image_part(RED)]
    with (
        OpenAI(base_url=f"{gateway.base_url}/v1", api_key=KEY, max_retries=0) as client,
        pytest.raises(openai.BadRequestError, match="does not take images") as refused,
    ):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}])
    assert refused.value.body["param"] == "messages[0].content[1]"  # type: ignore[index]


def test_an_assistant_message_cannot_carry_an_image(vl_gateway: RunningGateway) -> None:
    with _client(vl_gateway) as client, pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=MODEL,
            messages=[
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": [image_part(RED)]},  # type: ignore[list-item]
                {"role": "user", "content": "and?"},
            ],
        )


def test_each_image_is_processed_once_across_a_conversation(vl_gateway: RunningGateway) -> None:
    """An agent echoes its images every turn: the processor runs once per distinct image."""
    image = solid((17, 170, 17), (80, 80))
    before = _metric(vl_gateway, "gateway_images_processed_total"), _metric(vl_gateway, "gateway_images_total")
    with _client(vl_gateway) as client:
        messages: list[Any] = [{"role": "user", "content": [image_part(image)]}]
        for question in ("one", "two", "three"):
            reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4).choices[0].message
            messages += [{"role": "assistant", "content": reply.content}, {"role": "user", "content": question}]
    assert _metric(vl_gateway, "gateway_images_processed_total") - before[0] == 1
    assert _metric(vl_gateway, "gateway_images_total") - before[1] == 3


def _metric(gateway: RunningGateway, name: str) -> float:
    text = httpx.get(f"{gateway.base_url}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


# -- every protocol, every colour --------------------------------------------------------------------


def _png(colour: str, seed: int) -> bytes:
    return encode(vl_image(colour, (72 + 37 * seed, 150 - 21 * seed), seed=1000 + seed))


@pytest.mark.parametrize("protocol", ["chat", "messages", "responses"])
def test_different_images_get_different_answers_on_every_protocol(vl_gateway: RunningGateway, protocol: str) -> None:
    """The model names an image's colour; each protocol's own SDK sends the image its own way."""
    answers = {}
    for seed, colour in enumerate(sorted(VL_COLOURS)):
        data = _png(colour, seed)
        question = "What colour is this image?"
        if protocol == "chat":
            with _client(vl_gateway) as client:
                reply = client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": [image_part(data), {"type": "text", "text": question}]}],
                    max_tokens=16,
                    temperature=0,
                )
            answers[colour] = reply.choices[0].message.content
        elif protocol == "messages":
            source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(data).decode()}
            with anthropic.Anthropic(base_url=vl_gateway.base_url, api_key=KEY, max_retries=0) as claude:
                message = claude.messages.create(
                    model=MODEL,
                    max_tokens=16,
                    extra_body={"temperature": 0},  # not in the anthropic SDK 2.x signature
                    messages=[
                        {
                            "role": "user",
                            "content": [{"type": "image", "source": source}, {"type": "text", "text": question}],
                        }
                    ],  # type: ignore[list-item]
                )
            answers[colour] = "".join(b.text for b in message.content if b.type == "text")
        else:
            with _client(vl_gateway) as client:
                response = client.responses.create(
                    model=MODEL,
                    input=[
                        {
                            "role": "user",
                            "content": [
                                {"type": "input_image", "image_url": data_url(data), "detail": "auto"},
                                {"type": "input_text", "text": question},
                            ],
                        }
                    ],
                    max_output_tokens=16,
                    temperature=0,
                    store=False,
                )
            answers[colour] = response.output_text
    assert answers == {colour: vl_answer(colour) for colour in VL_COLOURS}


def test_fifty_concurrent_requests_with_one_megabyte_images_all_succeed(vl_model_path: Path) -> None:
    """A burst of large images queues for the two processing threads; nobody gets an error (what
    the model answers is not looked at: the transformers engine samples)."""
    import asyncio

    settings = Settings(model=str(vl_model_path), served_model_name=MODEL, max_batch_size=16)
    images = [encode(Image.frombytes("RGB", (600, 600), secrets.token_bytes(600 * 600 * 3))) for _ in range(50)]
    assert min(len(i) for i in images) > 1_000_000

    async def burst(base_url: str) -> list[int]:
        async with httpx.AsyncClient(base_url=base_url, headers=HEADERS, timeout=300) as client:

            async def one(data: bytes) -> int:
                body = {
                    "model": MODEL,
                    "max_tokens": 4,
                    "messages": [{"role": "user", "content": [image_part(data, "image/jpeg")]}],
                }
                return (await client.post("/v1/chat/completions", json=body)).status_code

            return list(await asyncio.gather(*(one(data) for data in images)))

    with run_gateway(build_engine(settings), settings) as running:
        statuses = asyncio.run(burst(running.base_url))
        assert statuses == [200] * len(images)
        assert _metric(running, "gateway_images_processed_total") == len(images)
        assert running.health()["status"] == "ok"


@pytest.mark.parametrize("fmt", ["JPEG", "WEBP", "GIF"])
def test_jpeg_webp_and_the_first_frame_of_a_gif_are_read(vl_gateway: RunningGateway, fmt: str) -> None:
    """Every accepted format is recorded with its media type; an animated GIF is its first frame."""
    first, second = vl_image("red", (96, 96), seed=5), vl_image("blue", (96, 96), seed=6)
    buffer = io.BytesIO()
    if fmt == "GIF":
        first.save(buffer, "GIF", save_all=True, append_images=[second], duration=100, loop=0)
    else:
        first.save(buffer, fmt)
    data = buffer.getvalue()
    media_type = f"image/{fmt.lower()}"
    session = f"vl{secrets.token_hex(4)}"
    with _client(vl_gateway, session) as client:
        content = [image_part(data, media_type), {"type": "text", "text": "What colour is this image?"}]
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=16, temperature=0
        )
    assert reply.choices[0].message.content == vl_answer("red")
    (turn,) = _session(vl_gateway, session)["turns"]
    assert turn["images"][0]["media_type"] == media_type and turn["images"][0]["sha256"] == image_digest(data)
