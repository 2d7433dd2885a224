"""Prometheus metrics of one server (own registry, so tests can run several servers in a process).

Request-level numbers are updated by the routes and the engine; expert-tier numbers are read from
the provider's ``TierStats`` at scrape time.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

# TierStats total field -> (metric suffix, help, counter?)
_TIER_FIELDS = {
    "lookups": ("expert_lookups", "Experts requested by the model", True),
    "hits_device": ("expert_hits_device", "Expert lookups served from the device (VRAM) tier", True),
    "hits_host": ("expert_hits_host", "Expert lookups served from the host (RAM) tier", True),
    "misses": ("expert_misses", "Expert lookups read from the store on demand", True),
    "bytes_read": ("expert_read_bytes", "Bytes read from the expert store (demand and prefetch)", True),
    "stall_time_s": ("expert_stall_seconds", "Seconds compute waited for expert reads or copies", True),
    "prefetch_issued": ("prefetch_issued", "Experts prefetched", True),
    "prefetch_useful": ("prefetch_useful", "Prefetched experts later used", True),
    "prefetch_wasted": ("prefetch_wasted", "Prefetched experts evicted unused", True),
    "hit_rate": ("expert_hit_rate", "Share of expert lookups that hit a tier", False),
    "prefetch_precision": ("prefetch_precision", "Share of prefetched experts that were used", False),
    "prefetch_recall": ("prefetch_recall", "Share of would-be misses that prefetch saved", False),
}


class _TierCollector:
    def __init__(self, provider):
        self.provider = provider

    def collect(self):
        stats = getattr(self.provider, "stats", None)
        if stats is None:
            return
        total = stats.snapshot()["total"]
        for key, (name, doc, is_counter) in _TIER_FIELDS.items():
            fam = (CounterMetricFamily if is_counter else GaugeMetricFamily)(f"lqf_{name}", doc)
            fam.add_metric([], float(total[key]))
            yield fam


class Metrics:
    def __init__(self, provider=None):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("lqf_requests", "HTTP requests by route and status", ["route", "status"], registry=r)
        self.prompt_tokens = Counter("lqf_prompt_tokens", "Prompt tokens of generations", registry=r)
        self.generation_tokens = Counter("lqf_generation_tokens", "Tokens generated", registry=r)
        self.prefill_computed = Counter("lqf_prefill_tokens_computed", "Prompt tokens run through the model",
                                        registry=r)
        self.prefill_reused = Counter("lqf_prefill_tokens_reused", "Prompt tokens taken from the prefix cache",
                                      registry=r)
        self.prefill_seconds = Counter("lqf_prefill_seconds", "Seconds spent prefilling", registry=r)
        self.decode_tokens = Counter("lqf_decode_tokens", "Tokens decoded after each generation's first",
                                     registry=r)
        self.decode_seconds = Counter("lqf_decode_seconds", "Seconds between each generation's first and last "
                                      "token (decode_tokens / decode_seconds = the engine's rate)", registry=r)
        self.cancelled = Counter("lqf_generations_cancelled", "Generations stopped because the client left",
                                 registry=r)
        self.rejected = Counter("lqf_requests_rejected_queue_full", "Requests refused with 429", registry=r)
        self.latency = Histogram("lqf_request_latency_seconds", "Request arrival to last token",
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("lqf_time_to_first_token_seconds", "Request arrival to first generated token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge("lqf_queue_depth", "Requests waiting for the model", registry=r)
        self.running = Gauge("lqf_generations_running", "Generations being decoded (up to server.max_active)", registry=r)
        self.prefix_cache_bytes = Gauge("lqf_prefix_cache_bytes", "Bytes held by prefix-cache snapshots",
                                        registry=r)
        self.prefix_cache_entries = Gauge("lqf_prefix_cache_entries", "Prefix-cache snapshots", registry=r)
        if provider is not None:
            r.register(_TierCollector(provider))

    def render(self) -> bytes:
        return generate_latest(self.registry)
