"""A dialect's reader driven as the remote engine drives it, for tests of what frames become."""

from __future__ import annotations

from typing import Any

from stream_gateway.engines import EngineStep
from stream_gateway.engines.remote._dialect import StepReader


def read_steps(reader: StepReader, reads: list[list[dict[str, Any]]]) -> list[EngineStep]:
    """The steps of ``reads`` (each one read's payloads) read to the stream's end."""
    steps: list[EngineStep] = []
    for events in reads:
        if reader.done:
            break
        steps += reader.feed(events)
    return steps + reader.end()
