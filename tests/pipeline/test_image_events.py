"""Images through NATS: stored once by hash before the turns that refer to them, carried by the
turns' events, kept by the outbox while NATS is away, and enough for another replica to continue
an image conversation token-exactly.

The model is ``tiny-vl-untrained`` (tiny-vl's tokenizer, template, image processor and architecture,
untrained, on the transformers engine): nothing here reads what it answers.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
import orjson
import pytest
from openai import OpenAI

from pipeline.connection import connect
from pipeline.embedded import EmbeddedNatsServer
from pipeline.events import Event, TurnCompleted
from pipeline.vision import ImageLimits, VisionProcessor, image_digest
from stream_gateway import Settings
from stream_gateway.engines import build_engine

from ..support.capture import KEY, of_session, replica_settings, wait_for
from ..support.servers import RunningGateway, run_gateway
from ..support.vision import image_part, solid

MODEL = "tiny-vl-untrained"
RED, GREEN = solid((220, 30, 30), (90, 60)), solid((30, 200, 30), (60, 90))


@pytest.fixture
def vl_settings(tmp_path: Path) -> Callable[..., Settings]:
    return replica_settings(MODEL, tmp_path)


def _turn(gateway: RunningGateway, session: str, messages: list[dict[str, Any]]) -> None:
    """One turn; appends the assistant message as received."""
    with OpenAI(base_url=f"{gateway.base_url}/sessions/{session}/v1", api_key=KEY, max_retries=0) as client:
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)  # type: ignore[arg-type]
    messages.append({"role": "assistant", "content": reply.choices[0].message.content})


def _turns(gateway: RunningGateway, session: str) -> list[dict[str, Any]]:
    response = httpx.get(f"{gateway.base_url}/sessions/{session}", headers={"authorization": f"Bearer {KEY}"})
    response.raise_for_status()
    turns: list[dict[str, Any]] = response.json()["turns"]
    return turns


def _completed(events: list[Event], session: str) -> list[TurnCompleted]:
    done = [e for e in of_session(events, session) if isinstance(e, TurnCompleted)]
    return sorted(done, key=lambda e: e.started_at)


def _objects(url: str) -> dict[str, bytes]:
    """Every object of the image bucket, by name."""

    async def read() -> dict[str, bytes]:
        nc = await connect(url, None)
        try:
            store = await nc.jetstream().object_store("sg_images")
            names = [info.name for info in await store.list()]
            return {name: (await store.get(name)).data or b"" for name in names}
        finally:
            await nc.close()

    return anyio.run(read)


def test_images_are_stored_once_and_a_replica_continues_the_conversation(
    vl_settings: Callable[..., Settings],
) -> None:
    with EmbeddedNatsServer() as server:
        first, second = vl_settings(server.url, "a"), vl_settings(server.url, "b")
        session = f"vl{secrets.token_hex(4)}"
        messages: list[dict[str, Any]] = [{"role": "user", "content": [image_part(RED), {"type": "text", "text": "?"}]}]
        with run_gateway(build_engine(first), first) as a, run_gateway(build_engine(second), second) as b:
            _turn(a, session, messages)
            messages.append({"role": "user", "content": [{"type": "text", "text": "and"}, image_part(GREEN)]})
            _turn(b, session, messages)  # another replica continues: it reads turn 1 from the stream
            messages.append({"role": "user", "content": "so?"})
            _turn(a, session, messages)  # and back: the red image is sent for the third time
            on_b = _turns(b, session)
            events = wait_for(server.url, lambda es: len(_completed(es, session)) >= 3, timeout=60)
            processor = a.engine.vision
        objects = _objects(server.url)
    assert processor is not None
    turns = _completed(events, session)
    assert [t.parent_turn_id for t in turns] == [None, turns[0].turn_id, turns[1].turn_id]
    red, green = image_digest(RED), image_digest(GREEN)
    assert [[i.sha256 for i in t.images] for t in turns] == [[red], [red, green], [red, green]]
    # Stored once each, by hash, whatever the number of turns and replicas that sent them.
    assert objects[f"images/{red}"] == RED and objects[f"images/{green}"] == GREEN
    assert sorted(objects) == sorted([f"images/{red}", f"images/{green}", f"processors/{processor.fingerprint}"])
    # A trainer rebuilds the processor from its record and gets the very pixels the model saw.
    rebuilt = VisionProcessor.from_record(orjson.loads(objects[f"processors/{processor.fingerprint}"]))
    for turn in turns:
        for record in turn.images:
            image = rebuilt.process(objects[f"images/{record.sha256}"], ImageLimits())
            assert (image.pixels_sha256, image.grid_thw, image.tokens) == (
                record.pixels_sha256,
                record.grid_thw,
                record.tokens,
            )
    # Replica b's copy of turn 2 is the one it served: the prompt holds turn 1's ids as recorded.
    mine = {t["turn_id"]: t for t in on_b}
    second_turn = mine[turns[1].turn_id]
    assert second_turn["reused_prompt_tokens"] == turns[1].reused_prompt_tokens > 0
    assert [i["sha256"] for i in second_turn["images"]] == [red, green]


def test_images_wait_in_the_outbox_while_nats_is_away(vl_settings: Callable[..., Settings]) -> None:
    with EmbeddedNatsServer() as server:
        settings = vl_settings(server.url)
        session = f"away{secrets.token_hex(4)}"
        messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
        with run_gateway(build_engine(settings), settings) as gateway:
            server.kill()
            try:
                messages = [{"role": "user", "content": [image_part(GREEN), {"type": "text", "text": "?"}]}]
                _turn(gateway, session, messages)
            finally:
                server.restart()
            events = wait_for(server.url, lambda es: len(_completed(es, session)) >= 1, timeout=90)
        objects = _objects(server.url)
    (turn,) = _completed(events, session)
    assert [i.sha256 for i in turn.images] == [image_digest(GREEN)]
    assert objects[f"images/{image_digest(GREEN)}"] == GREEN


def test_the_image_bucket_never_expires_what_later_turns_refer_to(tmp_path: Path) -> None:
    """Events may age out (``max_age_s``); an image stored once and referred to again must not."""
    from pipeline.publisher import EventPublisher, PublisherConfig
    from pipeline.streams import StreamSpec

    async def run(url: str) -> tuple[float, bytes]:
        spec = StreamSpec(max_age_s=3600.0)
        config = PublisherConfig(servers=(url,), outbox_dir=tmp_path / "outbox", stream=spec)
        async with EventPublisher(config) as publisher:
            publisher.put_object_nowait("images/abc", b"pixels")
            await publisher.wait_published()
        nc = await connect(url, None)
        try:
            store = await nc.jetstream().object_store("sg_images")
            status = await store.status()
            return float(status.ttl or 0), (await store.get("images/abc")).data or b""
        finally:
            await nc.close()

    with EmbeddedNatsServer() as server:
        ttl, data = anyio.run(run, server.url)
    assert (ttl, data) == (0.0, b"pixels")
