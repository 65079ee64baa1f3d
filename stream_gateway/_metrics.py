"""Prometheus metrics of one gateway, in a registry of its own (several apps may share a process)."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

# Publisher statistics fields: counters grow, gauges go up and down.
_PUBLISHER_COUNTERS = (
    "published", "spilled", "replayed", "large", "failures", "deltas_published", "deltas_dropped", "expired",
    "withheld",
)  # fmt: skip
_PUBLISHER_GAUGES = ("pending", "buffered", "outbox", "connected")

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class GatewayMetrics:
    """Requests, tokens, time to first token, inter-token latency and active streams."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._publisher_statistics: Callable[[], Any] | None = None
        self.requests = Counter(
            "gateway_requests", "Chat completion requests by outcome", ["stream", "status"], registry=self.registry
        )
        self.prompt_tokens = Counter("gateway_prompt_tokens", "Prompt tokens processed", registry=self.registry)
        # The engine's prefix-cache hits: the hit rate is cached over counted (of turns whose engine says).
        self.prompt_tokens_counted = Counter(
            "gateway_prompt_tokens_cache_counted",
            "Prompt tokens of finished turns whose engine reported its prefix-cache reuse",
            registry=self.registry,
        )
        self.prompt_tokens_cached = Counter(
            "gateway_prompt_tokens_cached",
            "Of those, the prompt tokens the engine served from its prefix cache (vLLM's cached_tokens)",
            registry=self.registry,
        )
        self.completion_tokens = Counter(
            "gateway_completion_tokens", "Completion tokens sampled", registry=self.registry
        )
        self.time_to_first_token = Histogram(
            "gateway_time_to_first_token_seconds",
            "Request arrival to first sampled token",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.inter_token_latency = BatchedHistogram(
            "gateway_inter_token_latency_seconds",
            "Time between consecutive engine steps of one choice",
            _LATENCY_BUCKETS,
        )
        self.registry.register(self.inter_token_latency)
        self.active_streams = Gauge("gateway_active_streams", "Responses in progress", registry=self.registry)
        self.aborted = Counter(
            "gateway_aborted_requests", "Requests whose client went away before the end", registry=self.registry
        )

        self.uncaptured = Counter(
            "gateway_uncaptured_requests",
            "Requests served without capture (their users did not consent): by the tenant's capture=off "
            "or the request's X-Capture: off",
            ["reason"],
            registry=self.registry,
        )

        self.context_fallbacks = Counter(
            "gateway_context_fallbacks",
            "Continued conversations rendered afresh because the template was not prefix-stable",
            registry=self.registry,
        )

        self._prompt_builds()

        self.images = Counter(
            "gateway_images",
            "Images in admitted requests (a conversation's images count once per request that sends them)",
            registry=self.registry,
        )
        self.images_processed = Counter(
            "gateway_images_processed",
            "Images run through the model's image processor (the others were processed before, by hash)",
            registry=self.registry,
        )
        self.route_rows_compared = Counter(
            "gateway_route_rows_compared",
            "Mixture of experts: (position, layer) rows a turn's prefill ran again over its ancestors' positions",
            registry=self.registry,
        )
        self.route_rows_disagreeing = Counter(
            "gateway_route_rows_disagreeing",
            "Of those, rows whose experts differ from the recorded ones (the recorded ones are kept)",
            registry=self.registry,
        )

        self.policy_version = Gauge(
            "gateway_policy_version", "The policy version the engine samples from", registry=self.registry
        )
        self.policy_updates = Counter(
            "gateway_policy_updates",
            "Policies applied or rejected, by outcome (applied, or the rejection reason)",
            ["outcome"],
            registry=self.registry,
        )
        self.policy_pause = Histogram(
            "gateway_policy_pause_seconds",
            "How long one weight update stopped decoding (tensor copy + KV recompute)",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.policy_download = Histogram(
            "gateway_policy_download_seconds",
            "Fetching and verifying a published policy (decoding goes on meanwhile)",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )

    def watch_publisher(self, statistics: Callable[[], Any]) -> None:
        """Export the event publisher's statistics (read at scrape time) as ``gateway_events_*``."""
        self._publisher_statistics = statistics
        self.registry.register(_PublisherCollector(statistics))

    def watch_sessions(self, store: Iterable[Any]) -> None:
        """Export the sessions held in memory (read at scrape time): how many, the token ids they
        hold in all, and per session as a histogram (``gateway_session_tokens``)."""
        self.registry.register(_SessionsCollector(store))

    def watch_histories(self, histories: Any) -> None:
        """Export the request histories kept in memory and the reads through them
        (``completion/_history.py``, ``completion/_kept.py``; read at scrape time)."""
        self.registry.register(_HistoriesCollector(histories))

    def publisher_statistics(self) -> Any:
        """The event publisher's statistics now, ``None`` with capture off."""
        return self._publisher_statistics() if self._publisher_statistics is not None else None

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)

    def _prompt_builds(self) -> None:
        """How prompts were built: cold or warm, what was tokenized and rendered, how token-in
        prompts found their parent (issue 41's counters)."""
        self.context_builds = Counter(
            "gateway_context_builds",
            "Chat prompts built: cold (the whole render tokenized: a first turn, a new root, a turn no "
            "longer in memory, images) or warm (a continuation tokenizing only what it adds)",
            ["kind"],
            registry=self.registry,
        )

        self.context_tokenized_chars = Counter(
            "gateway_context_tokenized_chars",
            "Characters of rendered chat templates tokenized to build prompts, by build kind (cold or warm)",
            ["kind"],
            registry=self.registry,
        )

        self.template_rendered_messages = Counter(
            "gateway_template_rendered_messages",
            "Messages the chat template was run for in recorded renders, by build kind: a continuation "
            "whose history repeats an earlier request's bytes replays that render and runs only what it adds",
            ["kind"],
            registry=self.registry,
        )

        self.token_in_matches = Counter(
            "gateway_token_in_matches",
            "Token-in prompts placed in a named session, by how: kept (the turn its kept prompt made, "
            "checked on its sampled ids alone) or ids (looked up by digests of the whole prompt)",
            ["how"],
            registry=self.registry,
        )


class BatchedHistogram(Collector):
    """A histogram fed a whole turn's observations at once (``observe_many``), off the per-token path.

    prometheus_client's ``Histogram.observe`` takes a lock and walks the buckets per call; a turn's
    inter-token gaps are instead gathered in a list by the producer and counted here at the end,
    one ``bisect`` each. Updated and scraped on the event loop's thread only, so no lock.
    """

    def __init__(self, name: str, documentation: str, buckets: Sequence[float]) -> None:
        self._name, self._documentation = name, documentation
        self._bounds = tuple(buckets)
        self._counts = [0] * (len(self._bounds) + 1)  # the last: above every bound (+Inf only)
        self._sum = 0.0

    def observe_many(self, values: Sequence[float]) -> None:
        """Count ``values`` (seconds)."""
        counts, bounds = self._counts, self._bounds
        for value in values:
            counts[bisect_left(bounds, value)] += 1
        self._sum += sum(values)

    def observe(self, value: float) -> None:
        """Count one value."""
        self.observe_many((value,))

    def collect(self) -> Iterator[Metric]:
        cumulative, running = [], 0
        for bound, count in zip((*map(floatToGoString, self._bounds), "+Inf"), self._counts, strict=True):
            running += count
            cumulative.append((bound, running))
        yield HistogramMetricFamily(self._name, self._documentation, buckets=cumulative, sum_value=self._sum)


_SESSION_TOKEN_BUCKETS = (1e3, 4e3, 16e3, 64e3, 128e3, 256e3, 512e3, 1e6, 2e6)


class _SessionsCollector(Collector):
    """The sessions a store holds, at scrape time (one pass over them)."""

    def __init__(self, store: Iterable[Any]) -> None:
        self._store = store

    def collect(self) -> Iterator[Metric]:
        counts = [0] * (len(_SESSION_TOKEN_BUCKETS) + 1)
        held = sessions = 0
        for session in self._store:
            sessions += 1
            held += session.held_tokens
            counts[bisect_left(_SESSION_TOKEN_BUCKETS, session.held_tokens)] += 1
        yield GaugeMetricFamily("gateway_sessions_in_memory", "Sessions held in this process's memory", sessions)
        yield GaugeMetricFamily(
            "gateway_session_tokens_held",
            "Token ids the sessions in memory hold (every turn's prompt and output; --max-session-tokens bounds it)",
            held,
        )
        cumulative, running = [], 0
        for bound, count in zip((*map(floatToGoString, _SESSION_TOKEN_BUCKETS), "+Inf"), counts, strict=True):
            running += count
            cumulative.append((bound, running))
        yield HistogramMetricFamily(
            "gateway_session_tokens", "Token ids held per session in memory", buckets=cumulative, sum_value=held
        )


class _HistoriesCollector(Collector):
    """The request histories kept for continuing conversations, and the reads through them, at
    scrape time (``Histories.statistics()``)."""

    def __init__(self, histories: Any) -> None:
        self._histories = histories

    def collect(self) -> Iterator[Metric]:
        stats = self._histories.statistics()
        yield GaugeMetricFamily(
            "gateway_history_cache_bytes",
            "Bytes of request histories kept so a continuing turn reads only what it adds (--history-cache-bytes)",
            stats.held_bytes,
        )
        yield GaugeMetricFamily(
            "gateway_history_cache_entries", "Request histories kept (one per conversation)", stats.entries
        )
        yield CounterMetricFamily(
            "gateway_history_cache_hits",
            "Bodies (chat, Messages, Responses, token-in) that continued a kept history: only what they add read",
            stats.hits,
        )
        yield CounterMetricFamily(
            "gateway_history_cache_misses",
            "Bodies over 4 KiB that continued no kept history (read whole)",
            stats.misses,
        )
        reads = CounterMetricFamily(
            "gateway_history_reads",
            "Requests that derived a fact (parsed, translated, keyed, templated, rendered...) through their kept "
            "history: read=delta took the kept part and derived only what they add, read=whole derived it all",
            labels=["fact", "read"],
        )
        for (fact, read), count in sorted(stats.reads.items()):
            reads.add_metric([fact, read], count)
        yield reads
        items = CounterMetricFamily(
            "gateway_history_read_items",
            "Items (messages, token ids; rendered: template loop iterations) a fact was derived for anew",
            labels=["fact"],
        )
        for fact, count in sorted(stats.items.items()):
            items.add_metric([fact], count)
        yield items


class _PublisherCollector(Collector):
    def __init__(self, statistics: Callable[[], Any]) -> None:
        self._statistics = statistics

    def collect(self) -> Iterator[Metric]:
        stats = self._statistics()
        for name in _PUBLISHER_COUNTERS:
            yield CounterMetricFamily(f"gateway_events_{name}", f"Event publisher: {name}", value=getattr(stats, name))
        for name in _PUBLISHER_GAUGES:
            yield GaugeMetricFamily(
                f"gateway_events_{name}", f"Event publisher: {name}", value=float(getattr(stats, name))
            )
