"""Shared fixtures: the tiny models on disk and real uvicorn gateways on free ports.

No fixture here needs a trained model. Where a test needs tiny-agent's answers (a tool call to
whichever reading tool is offered, "done" after the result, hello otherwise), the ``scripted``
engine gives them on the untrained ``tiny`` (same tokenizer, template and architecture as
tiny-agent); thinking and images come the same way from ``tiny-reasoning-untrained`` and
``tiny-vl-untrained``. Only the models' own tests (marker ``trained``) load trained weights.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from openai import AsyncOpenAI, OpenAI

from stream_gateway import Settings
from stream_gateway.engines import build_engine
from stream_gateway.models import (
    build_tiny_model,
    build_tiny_reasoning_untrained_model,
    build_tiny_vl_untrained_model,
)

from .support.capture import capture_gateway, capture_settings
from .support.nats_fixtures import nats_server
from .support.servers import RunningGateway, run_gateway, scripted_settings

__all__ = ["capture_gateway", "capture_settings", "nats_server"]  # fixtures defined elsewhere, offered to every test


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    """The deterministic tiny Qwen2 test model (built once, cached)."""
    return build_tiny_model()


@pytest.fixture(scope="session")
def agent_model_path(tiny_model_path: Path) -> Path:
    """The model agent tests serve: the untrained ``tiny``; serve it with ``engine="scripted"`` for
    tiny-agent's answers (any reading tool: ``read``, Claude Code's ``Read``, Codex's ``exec_command``)."""
    return tiny_model_path


@pytest.fixture(scope="session")
def reasoning_model_path() -> Path:
    """``tiny-reasoning-untrained``: tiny-reasoning's tokenizer and thinking template, untrained."""
    return build_tiny_reasoning_untrained_model()


@pytest.fixture(scope="session")
def vl_model_path() -> Path:
    """``tiny-vl-untrained``: tiny-vl's tokenizer, template, image processor and architecture, untrained."""
    return build_tiny_vl_untrained_model()


@pytest.fixture(scope="session")
def agent_gateway(agent_model_path: Path) -> Iterator[RunningGateway]:
    """A gateway answering as ``tiny-agent`` (the scripted engine on ``tiny``), shared by the session."""
    settings = scripted_settings(agent_model_path)
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
