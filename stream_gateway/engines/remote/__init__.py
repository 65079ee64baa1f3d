"""Remote engines: a pool of vLLM (``vllm-http``) or SGLang (``sglang-http``) servers samples.

One engine (:mod:`._engine`) owns lifecycle, the pool, health and failover; one module per wire
dialect (:mod:`._vllm`, :mod:`._sglang`) behind one small seam (:mod:`._dialect`: the request
body, frames -> steps); the LoRA adapter fleet (:mod:`._adapters`), route checks
(:mod:`._routes`), shared wire readers (:mod:`._wire`) and the streaming HTTP client
(:mod:`._stream_http`) beside them. See ``docs/engines.md``.
"""

from stream_gateway._errors import UpstreamFailed
from stream_gateway.engines.remote._adapters import adapter_model
from stream_gateway.engines.remote._dialect import Dialect, Exchange
from stream_gateway.engines.remote._engine import DIALECTS, PROTOCOLS, RemoteEngine
from stream_gateway.engines.remote._routes import RouteCheck, Wanted

__all__ = [
    "DIALECTS",
    "Dialect",
    "Exchange",
    "PROTOCOLS",
    "RemoteEngine",
    "RouteCheck",
    "UpstreamFailed",
    "Wanted",
    "adapter_model",
]
