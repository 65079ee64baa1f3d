"""``python -m model_recipes NAME [--out DIR] [--cache-dir DIR]``: train NAME again, write its weights file.

The file goes to the package's weights (``stream_gateway/models/weights/NAME.safetensors``) unless
``--out`` says otherwise; the last lines printed are its path and its sha256, which
``SHIPPED_WEIGHTS`` in ``stream_gateway/models/_shipped.py`` must record before the gateway serves
it. Training takes minutes on two cores; its progress goes to stderr.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from model_recipes._recipes import RECIPES, SHIPPED_WEIGHTS_DIR, sha256, train_weights


def main(argv: list[str] | None = None) -> int:
    """Train the model ``argv`` names, write its weights file, print the file and its sha256 last."""
    parser = argparse.ArgumentParser(
        prog="python -m model_recipes", description="Train a trained built-in model again and write its weights file."
    )
    parser.add_argument("name", choices=sorted(RECIPES), help="the trained built-in model to train again")
    parser.add_argument("--out", type=Path, default=SHIPPED_WEIGHTS_DIR, help="where NAME.safetensors goes")
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="where its parent and starting point are built (default: a temp dir)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("model_recipes").setLevel(logging.INFO)
    started = time.perf_counter()
    path = train_weights(args.name, args.out, args.cache_dir)
    digest = sha256(path)
    print(f"{args.name}: trained in {time.perf_counter() - started:.0f} s, {path.stat().st_size:,} bytes")
    print(f'record it in stream_gateway/models/_shipped.py: SHIPPED_WEIGHTS["{args.name}"] = "{digest}"')
    print(path)
    print(digest)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
