"""Fixtures of the consumers' image tests: tiny-vl on disk, its processor and its tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pipeline.vision import VisionProcessor
from stream_gateway.models import resolve_model

from ..support.images import vl_processor


@pytest.fixture(scope="module")
def vl_path() -> Path:
    return Path(resolve_model("tiny-vl"))


@pytest.fixture(scope="module")
def processor(vl_path: Path) -> VisionProcessor:
    return vl_processor(vl_path)


@pytest.fixture(scope="module")
def tokenizer(vl_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(vl_path)
