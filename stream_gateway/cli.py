"""The ``stream-gateway`` command.

Subcommands:

* ``serve``: the OpenAI-compatible gateway on one engine.
* ``prepare-model``: build or convert a local model (``tiny``, ``tiny-agent``, ``smollm2``) and print its path.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from ._settings import Settings
from .engines import ENGINE_NAMES, Engine, create_engine


def build_engine(settings: Settings) -> Engine:
    """The engine ``settings`` ask for, built (not started) on the resolved local model."""
    from .model_store import resolve_model

    model = resolve_model(settings.model, settings.model_cache_dir)
    options: dict[str, Any] = {}
    if settings.engine == "transformers":
        options = {
            "served_model_name": settings.served_model_name or _default_name(settings.model),
            "max_batch_size": settings.max_batch_size,
            "max_model_len": settings.max_model_len,
            "device": settings.device,
        }
    elif settings.engine == "synthetic":
        options = {
            "served_model_name": settings.served_model_name or "synthetic",
            "tokens_per_second": settings.synthetic_tokens_per_second,
        }
        if settings.max_model_len:
            options["max_model_len"] = settings.max_model_len
    elif settings.engine == "vllm":
        options = {
            "served_model_name": settings.served_model_name or _default_name(settings.model),
            "max_model_len": settings.max_model_len,
        }
    return create_engine(settings.engine, model, **options)


def _default_name(model: str) -> str:
    """Clients address the built-in models by their short names, others by their last path part."""
    return model.rstrip("/").rsplit("/", 1)[-1]


def _serve(settings: Settings) -> int:
    import uvicorn

    from .app import create_app

    engine = build_engine(settings)
    app = create_app(engine, settings)
    print(
        f"stream-gateway: {settings.engine} engine, model {engine.model_id!r}, "
        f"OpenAI API at http://{settings.host}:{settings.port}/v1 (metrics at /metrics)",
        file=sys.stderr,
        flush=True,
    )
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level)
    return 0


def _prepare_model(settings: Settings) -> int:
    from .model_store import resolve_model

    print(resolve_model(settings.model, settings.model_cache_dir))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stream-gateway", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the OpenAI-compatible gateway")
    serve.add_argument("--model", help="'smollm2' (default), 'tiny', 'tiny-agent', a local HF model dir, or a hub id")
    serve.add_argument("--engine", choices=ENGINE_NAMES, help="default: transformers")
    serve.add_argument("--served-model-name", help="the model name clients send (default: from --model)")
    serve.add_argument("--host", help="default: 127.0.0.1")
    serve.add_argument("--port", type=int, help="default: 8000")
    serve.add_argument("--api-key", action="append", dest="api_keys", help="accepted key (repeatable)")
    serve.add_argument("--max-batch-size", type=int, help="transformers engine batch size (default 16)")
    serve.add_argument("--max-model-len", type=int, help="cap on prompt + completion tokens")
    serve.add_argument("--device", help="torch device for the transformers engine (default cpu)")
    serve.add_argument("--synthetic-tokens-per-second", type=float, help="synthetic engine rate")
    serve.add_argument("--default-max-tokens", type=int, help="completion budget when none is asked")
    serve.add_argument("--model-cache-dir", help="where built/converted models are cached")
    serve.add_argument("--log-level", help="uvicorn/gateway log level (default info)")
    serve.set_defaults(run=_serve)

    prepare = commands.add_parser("prepare-model", help="build/convert a local model and print its path")
    prepare.add_argument("--model", help="'smollm2' (default), 'tiny' or 'tiny-agent'")
    prepare.add_argument("--model-cache-dir", help="where built/converted models are cached")
    prepare.set_defaults(run=_prepare_model)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``stream-gateway`` console script."""
    args = _parser().parse_args(argv)
    flags = {k: v for k, v in vars(args).items() if k not in ("command", "run") and v is not None}
    if "api_keys" in flags:
        flags["api_keys"] = tuple(flags["api_keys"])
    settings = Settings(**flags)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    result: int = args.run(settings)
    return result


if __name__ == "__main__":
    raise SystemExit(main())
