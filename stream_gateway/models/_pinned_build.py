"""``python -m stream_gateway.models._pinned_build SPEC ROOT``: the child that builds one named model.

Started by ``_cache._cached_build`` with ``PINNED_NUMERICS`` in its environment (see ``_cache``).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path


def _pinned_build(spec: str, root: Path) -> None:
    import torch

    from stream_gateway.models._registry import resolve_model

    # oneDNN picks its kernels by the CPU too; off, convolutions (tiny-vl's patch embedding) take
    # torch's own path, whose matrix products are MKL's pinned ones.
    with torch.backends.mkldnn.flags(enabled=False):
        resolve_model(spec, root)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    _pinned_build(sys.argv[1], Path(sys.argv[2]))
