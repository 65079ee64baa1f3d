"""The exported JSON Schemas: never stale, and enough on their own to read the stream.

The subscriber test reads real events, published by the real publisher to a real nats-server,
with nothing but nats-py, ``json`` and ``jsonschema``: the way a consumer in another language or
another repository would, knowing only ``docs/events/``.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio
import jsonschema
import nats
import pytest
from nats.js.api import AckPolicy, ConsumerConfig

from pipeline.embedded import EmbeddedNatsServer, NatsServerConfig
from pipeline.events import DURABLE_KINDS, Event
from pipeline.publisher import EventPublisher, PublisherConfig

from ..support.events import one_of_each, turn_completed

ROOT = Path(__file__).resolve().parents[2]
SCHEMA_DIR = ROOT / "docs" / "events"
SCRIPT = ROOT / "scripts" / "export_event_schemas.py"


def load_exporter() -> ModuleType:
    """``scripts/export_event_schemas.py`` as a module (``scripts`` is not a package)."""
    spec = importlib.util.spec_from_file_location("export_event_schemas", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def committed_schemas() -> dict[str, dict[str, Any]]:
    """The schema files in ``docs/events/``, keyed by kind."""
    return {
        path.name.removesuffix(".schema.json"): json.loads(path.read_text())
        for path in sorted(SCHEMA_DIR.glob("*.schema.json"))
    }


# -- the files are current -----------------------------------------------------------------


def test_committed_docs_equal_the_generated_ones() -> None:
    """If this fails, run ``.venv/bin/python scripts/export_event_schemas.py`` and commit."""
    exporter = load_exporter()
    assert [str(p.relative_to(ROOT)) for p in exporter.stale_files()] == []
    assert set(committed_schemas()) == {*DURABLE_KINDS, "turn.delta"}


def test_check_mode_of_the_script_passes() -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr


def test_check_mode_finds_stale_files_and_a_run_fixes_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    exporter = load_exporter()
    schemas, reference = tmp_path / "docs" / "events", tmp_path / "docs" / "events.md"
    monkeypatch.setattr(exporter, "ROOT", tmp_path)
    monkeypatch.setattr(exporter, "SCHEMA_DIR", schemas)
    monkeypatch.setattr(exporter, "REFERENCE", reference)
    reference.parent.mkdir()
    reference.write_text(f"# Events\n\n{exporter.BEGIN}\nold tables\n{exporter.END}\n\nThe end.\n")
    assert exporter.main(["--check"]) == 1
    assert "stale: docs/events.md" in capsys.readouterr().err

    assert exporter.main([]) == 0
    assert exporter.main(["--check"]) == 0
    text = reference.read_text()
    assert text.startswith("# Events\n\n") and text.endswith(f"{exporter.END}\n\nThe end.\n")
    assert "old tables" not in text
    assert "| `finish_reason` |" in text

    (schemas / "turn.completed.schema.json").write_text("{}\n")
    (schemas / "turn.retired.schema.json").write_text("{}\n")
    assert exporter.main(["--check"]) == 1
    assert exporter.main([]) == 0
    assert not (schemas / "turn.retired.schema.json").exists()
    assert exporter.main(["--check"]) == 0


def test_the_schema_files_are_valid_draft_2020_12() -> None:
    for kind, schema in committed_schemas().items():
        jsonschema.Draft202012Validator.check_schema(schema)
        assert schema["properties"]["kind"]["const"] == kind


# -- a subscriber that knows only the schemas -----------------------------------------------


async def _quiet(exc: Exception) -> None:
    """nats-py reports connection trouble through this callback; nothing is expected here."""


async def read_with_plain_nats(url: str, expected: int) -> list[tuple[str, dict[str, Any]]]:
    """Subjects and JSON bodies of the stream's first ``expected`` events, via nats-py only."""
    nc = await nats.connect(url, error_cb=_quiet, max_reconnect_attempts=2)
    try:
        js = nc.jetstream()
        sub = await js.pull_subscribe(
            "sg.events.>", stream="SG_EVENTS", config=ConsumerConfig(ack_policy=AckPolicy.NONE)
        )
        out: list[tuple[str, dict[str, Any]]] = []
        while len(out) < expected:
            for msg in await sub.fetch(expected - len(out), timeout=5):
                data = msg.data
                ref = (msg.headers or {}).get("Sg-Payload-Object")
                if ref is not None:  # too large for one message: the JSON is in the object store
                    bucket, _, name = ref.partition("/")
                    stored = await (await js.object_store(bucket)).get(name)
                    assert stored.data is not None
                    data = stored.data
                out.append((msg.subject, json.loads(data)))
        return out
    finally:
        await nc.close()


@pytest.mark.anyio
async def test_a_subscriber_written_against_the_schemas_reads_every_event(tmp_path: Path) -> None:
    schemas = committed_schemas()
    # A small max payload, so that a modest prompt already takes the object store path.
    config = NatsServerConfig(max_payload=64 * 1024)
    sample = one_of_each()
    large = turn_completed("sess-1", 7, turn_id="turn-3", prompt_ids=list(range(30_000)))
    durable: list[Event] = [*(e for e in sample if e.durable), large]
    delta = next(e for e in sample if not e.durable)

    with anyio.fail_after(60), EmbeddedNatsServer(config) as server:
        live = await nats.connect(server.url, error_cb=_quiet, max_reconnect_attempts=2)
        try:
            deltas = await live.subscribe("sg.live.>")
            await live.flush()
            publisher_config = PublisherConfig(servers=(server.url,), outbox_dir=tmp_path / "outbox")
            async with EventPublisher(publisher_config) as publisher:
                while True:  # connected, so that the live delta is sent rather than dropped
                    if publisher.statistics().connected:
                        break
                    await anyio.sleep(0.01)
                for event in [*sample, large]:
                    publisher.publish_nowait(event)
                await publisher.wait_published()
                assert publisher.statistics().large == 1
            delta_body = json.loads((await deltas.next_msg(timeout=5)).data)
        finally:
            await live.close()
        read = await read_with_plain_nats(server.url, len(durable))

    for subject, body in read:
        jsonschema.validate(body, schemas[body["kind"]])
        assert subject.endswith("." + body["kind"])
    jsonschema.validate(delta_body, schemas["turn.delta"])

    # What the schema-only reader got is the whole event, oversized prompt included.
    assert [body for _, body in read] == [e.model_dump(mode="json") for e in durable]
    assert delta_body == delta.model_dump(mode="json")
    assert {body["kind"] for _, body in read} == DURABLE_KINDS


@pytest.mark.parametrize(
    ("kind", "change"),
    [
        ("feedback.recorded", {"score": "high"}),
        ("feedback.recorded", {"kind": "turn.completed"}),
        ("session.closed", {"reason": "bored"}),
        ("turn.completed", {"surprise": True}),
        ("turn.completed", {"usage": {"prompt_tokens": -1, "completion_tokens": 1}}),
        ("turn.started", {"seq": -1}),
        ("session.opened", {"event_id": None}),
    ],
)
def test_the_schemas_reject_what_the_models_reject(kind: str, change: dict[str, Any]) -> None:
    body = next(e for e in one_of_each() if e.kind == kind).model_dump(mode="json")
    schema = committed_schemas()[kind]
    jsonschema.validate(body, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**body, **change}, schema)


def test_a_missing_field_is_rejected() -> None:
    body = one_of_each()[0].model_dump(mode="json")
    del body["kind"]
    with pytest.raises(jsonschema.ValidationError, match="'kind' is a required property"):
        jsonschema.validate(body, committed_schemas()["session.opened"])
