"""Shared fixtures: the tiny model on disk and real uvicorn gateways on free ports."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from openai import AsyncOpenAI, OpenAI

from stream_gateway import Settings
from stream_gateway.engines import build_engine
from stream_gateway.models import build_tiny_agent_model, build_tiny_model

from .support.capture import capture_gateway, capture_settings
from .support.nats_fixtures import nats_server
from .support.servers import RunningGateway, run_gateway

__all__ = ["capture_gateway", "capture_settings", "nats_server"]  # fixtures defined elsewhere, offered to every test


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    """The deterministic tiny Qwen2 test model (built once, cached)."""
    return build_tiny_model()


@pytest.fixture(scope="session")
def agent_model_path() -> Path:
    """``tiny-agent``: the tiny model fine-tuned (at build time) to call the ``read`` tool."""
    return build_tiny_agent_model()


@pytest.fixture(scope="session")
def claude_agent_model_path() -> Path:
    """``tiny-agent-claude``: the same recipe, calling Claude Code's ``Read``."""
    return build_tiny_agent_model(variant="tiny-agent-claude")


@pytest.fixture(scope="session")
def codex_agent_model_path() -> Path:
    """``tiny-agent-codex``: the same recipe, calling Codex's shell tool ``exec_command``."""
    return build_tiny_agent_model(variant="tiny-agent-codex")


@pytest.fixture(scope="session")
def agent_gateway(agent_model_path: Path) -> Iterator[RunningGateway]:
    """A gateway serving ``tiny-agent``, shared by the session."""
    settings = Settings(model=str(agent_model_path), served_model_name="tiny-agent")
    with run_gateway(build_engine(settings), settings) as running:
        yield running


@pytest.fixture(scope="session")
def gateway(tiny_model_path: Path) -> Iterator[RunningGateway]:
    """A gateway on the transformers engine serving the tiny model, shared by the session."""
    settings = Settings(model=str(tiny_model_path), served_model_name="tiny", max_batch_size=8)
    with run_gateway(build_engine(settings), settings) as running:
        yield running


@pytest.fixture
def client(gateway: RunningGateway) -> Iterator[OpenAI]:
    """The official synchronous OpenAI client pointed at the shared gateway."""
    with OpenAI(base_url=gateway.base_url + "/v1", api_key="sk-test", timeout=60, max_retries=0) as c:
        yield c


@pytest.fixture
async def async_client(gateway: RunningGateway) -> AsyncIterator[AsyncOpenAI]:
    """The official asynchronous OpenAI client pointed at the shared gateway."""
    async with AsyncOpenAI(base_url=gateway.base_url + "/v1", api_key="sk-test", timeout=60, max_retries=0) as c:
        yield c


@pytest.fixture
def anyio_backend() -> str:
    """Async tests run on asyncio, like the gateway."""
    return "asyncio"
