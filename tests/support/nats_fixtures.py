"""Pytest fixtures for a real ``nats-server`` with JetStream (import them into a conftest)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pipeline.embedded import EmbeddedNatsServer


@pytest.fixture(scope="session")
def nats_server() -> Iterator[EmbeddedNatsServer]:
    """One started server with a temp store, shared by the session; free ports, loopback only.

    Tests that kill, pause or restart a server should start their own instead.
    """
    with EmbeddedNatsServer() as server:
        yield server
