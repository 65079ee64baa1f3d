"""``/openapi.json``: FastAPI's document of the routes, with the request bodies they parse.

The routes read their bodies themselves (OpenAI's error shapes, null handling, size limits), so
FastAPI cannot see them; each router lists the bodies of its routes (the generation router derives
its list from the edges), and this module puts their schemas into the document.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

__all__ = ["install_openapi"]


def install_openapi(app: FastAPI, bodies: Mapping[str, type[BaseModel]], model: str) -> None:
    """Serve ``app``'s OpenAPI document with ``bodies`` (path -> model); ``model`` is the one
    served model id, the only value the completion routes accept."""
    app.openapi = partial(_openapi, app, dict(bodies), model)  # type: ignore[method-assign]


def _openapi(app: FastAPI, bodies: dict[str, type[BaseModel]], model: str) -> dict[str, Any]:
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for path, kind in bodies.items():
            body = kind.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            if "model" in body.get("properties", {}):
                body["properties"]["model"] = {"type": "string", "enum": [model], "title": "Model"}
            components[kind.__name__] = body
            schema["paths"][path]["post"]["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{kind.__name__}"}}},
            }
        app.openapi_schema = schema
    return app.openapi_schema
