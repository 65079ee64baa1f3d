"""The recipes that train the gateway's trained built-in models: development tools, not the gateway.

``stream_gateway.models`` ships the trained models' weights as files (``SHIPPED_WEIGHTS``) and
builds only what trains nothing. How those weights were made lives here, in the repository and not
in the wheel: the synthetic agent corpus and the fine-tuning loop (``_agent_corpus.py``,
``_agent_training.py``: tiny-agent and its variants), tiny-reasoning's (``_reasoning.py``) and
tiny-vl's (``_vl.py``) training, and which model each starts from (``_recipes.py``). After changing
a recipe, one command trains the model again and writes its shipped file::

    .venv/bin/python -m model_recipes tiny-agent-codex

It prints the file and its sha256, to record as ``SHIPPED_WEIGHTS[NAME]`` in
``stream_gateway/models/_shipped.py``; then run the ``trained`` test lane (tests/README.md).

Deliberate choices:

* The recipes are white-box on ``stream_gateway.models``: like the tests, they import its private
  modules (the synthetic text of ``_corpus``, the tokenizer and model assembly of ``_tiny``,
  ``_tiny_reasoning`` and ``_tiny_vl``), because a recipe extends an untrained starting point and
  must stay in step with it byte for byte. No other package may (tests/unit/test_public_api.py),
  and the gateway never imports this one.
* A recipe is deterministic on one machine (seeded corpora, fp32, two threads, no dropout), not
  across machines: torch and MKL pick their float kernels by the CPU, and training amplifies the
  last-bit differences. That is why the weights ship as files.
"""

from __future__ import annotations

from model_recipes._recipes import RECIPES, SHIPPED_WEIGHTS_DIR, Recipe, build_model, sha256, train_weights

__all__ = ["RECIPES", "SHIPPED_WEIGHTS_DIR", "Recipe", "build_model", "sha256", "train_weights"]
