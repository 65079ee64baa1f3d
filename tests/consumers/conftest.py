"""Fixtures of the consumers' image tests: tiny-vl-untrained on disk, its processor and its tokenizer.

A consumer test builds batches and checks their layout, never what a model says: the untrained
variant has tiny-vl's tokenizer, template, image processor and architecture, and builds in seconds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pipeline.vision import VisionProcessor

from ..support.images import vl_processor


@pytest.fixture(scope="module")
def vl_path(vl_model_path: Path) -> Path:
    """``tiny-vl-untrained`` (the session's ``vl_model_path``)."""
    return vl_model_path


@pytest.fixture(scope="module")
def processor(vl_path: Path) -> VisionProcessor:
    return vl_processor(vl_path)


@pytest.fixture(scope="module")
def tokenizer(vl_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(vl_path)
