"""Prometheus metrics of one server (own registry, so tests can run several servers in a process).

Request-level numbers are updated by the routes and the engine; expert-tier numbers are read from
the provider's ``TierStats`` at scrape time.
"""
from __future__ import annotations

import collections
import threading
import time
from pathlib import Path

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


class _Recent:
    """A Prometheus metric that also keeps its last ``n`` updates with their times (the dashboard's
    series): ``observe``/``inc`` go to both."""

    def __init__(self, metric, n: int = 512):
        self.metric = metric
        self.events: collections.deque = collections.deque(maxlen=n)

    def observe(self, value) -> None:
        self.metric.observe(value)
        self.events.append((time.time(), float(value)))

    def inc(self, value=1) -> None:
        self.metric.inc(value)
        self.events.append((time.time(), float(value)))

    def __getattr__(self, name):
        return getattr(self.metric, name)


class Metrics:
    def __init__(self, provider=None):
        self.provider = provider
        self.started = time.time()
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
        # The dashboard's series: one point per generation (its TTFT; its decode tokens and seconds).
        self.ttft = _Recent(self.ttft)
        self.decode_tokens = _Recent(self.decode_tokens)
        self.decode_seconds = _Recent(self.decode_seconds)
        self._disk_gbps = None
        self._disk_probe: threading.Thread | None = None

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # -- the dashboard's JSON (/v1/stats) --------------------------------------------------------

    def disk_gbps(self):
        """The pack drive's read speed, measured once in the background with the doctor's probe
        (``io_engine.measure_random_reads``, record-sized reads); None until it is known."""
        store = getattr(self.provider, "store", None)
        if store is None or self._disk_probe is not None:
            return self._disk_gbps
        path = Path(store.path) / "experts.bin"
        block = store.max_record_bytes

        def probe():
            from lean_qwenflash.io_engine import measure_random_reads, open_engine
            try:
                eng = open_engine(path, "auto", queue_depth=8)
                try:
                    done, dt = measure_random_reads(eng, block, 0.5)
                finally:
                    eng.close()
                self._disk_gbps = done * block / dt / 1e9 if dt > 0 else None
            except Exception:           # a pack smaller than one read, no O_DIRECT...: no line on the chart
                self._disk_gbps = None

        self._disk_probe = threading.Thread(target=probe, name="lqf-disk-probe", daemon=True)
        self._disk_probe.start()
        return self._disk_gbps

    def snapshot(self, engine=None) -> dict:
        """Everything the dashboard draws, as plain JSON: counters (the page takes rates from two
        polls), the recent per-generation series, expert tiers per layer, cache occupancy."""
        def val(m):
            return m._value.get()

        out = {
            "time": time.time(), "uptime_s": time.time() - self.started,
            "requests": {"active": int(self.running._value.get()), "queued": int(self.queue_depth._value.get()),
                         "cancelled": val(self.cancelled), "rejected": val(self.rejected)},
            "tokens": {"prompt": val(self.prompt_tokens), "generated": val(self.generation_tokens),
                       "prefill_computed": val(self.prefill_computed), "prefill_reused": val(self.prefill_reused),
                       "prefill_seconds": val(self.prefill_seconds), "decode": val(self.decode_tokens.metric),
                       "decode_seconds": val(self.decode_seconds.metric)},
            "series": {
                "ttft": [[t, v] for t, v in self.ttft.events],
                # decode_tokens and decode_seconds are counted together, once per generation
                "decode": [[t, n, s] for (t, n), (_, s) in zip(self.decode_tokens.events, self.decode_seconds.events)],
            },
            "prefix_cache": {"entries": int(self.prefix_cache_entries._value.get()),
                             "bytes": int(self.prefix_cache_bytes._value.get())},
            "disk_gbps": self.disk_gbps(),
        }
        if engine is not None:
            out["requests"].update(active=engine.active_count, queued=engine.queue_depth)
            pc = engine.prefix_cache
            out["prefix_cache"].update(entries=len(pc), bytes=pc.used_bytes, capacity_bytes=pc.capacity_bytes)
        p = self.provider
        stats = getattr(p, "stats", None)
        if stats is not None:
            snap = stats.snapshot()
            keep = ("lookups", "hits_device", "hits_host", "misses", "bytes_read", "read_time_s", "stall_time_s",
                    "hit_rate", "read_gbps", "prefetch_issued", "prefetch_useful")
            out["experts"] = {"total": {k: snap["total"][k] for k in keep},
                              "layers": {str(l): {k: c[k] for k in ("lookups", "hits_device", "hits_host", "misses")}
                                         for l, c in snap["layers"].items()}}
            tiers = {}
            for name, cache in (("host", getattr(p, "host", None)), ("device", getattr(p, "dev", None))):
                if cache is None:
                    continue
                tiers[name] = {"slots": cache.num_slots, "used": cache.num_keys(), "policy": cache.policy,
                               "pinned": cache.num_pinned(), "slot_bytes": p.slot_bytes,
                               "bytes": cache.num_slots * p.slot_bytes}
            out["caches"] = tiers
        return out


UI_DIR = Path(__file__).resolve().parent / "ui"
_UI_FILES = {"": ("index.html", "text/html; charset=utf-8"),
             "dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
             "dashboard.css": ("dashboard.css", "text/css; charset=utf-8")}
UI_PATHS = {"/ui", "/ui/"} | {f"/ui/{k}" for k in _UI_FILES if k}


def register_dashboard(app, srv) -> None:
    """``GET /v1/stats`` (the JSON above) and the live dashboard at ``/ui`` (static files of
    ``server/ui/``, polling /v1/stats)."""
    from fastapi import HTTPException
    from fastapi.responses import JSONResponse, Response

    @app.get("/v1/stats")
    async def stats():
        return JSONResponse(srv.metrics.snapshot(srv.engine))

    @app.get("/ui")
    @app.get("/ui/")
    @app.get("/ui/{name}")
    async def ui(name: str = ""):
        if name not in _UI_FILES:
            raise HTTPException(404, f"no dashboard file {name!r}")
        fname, media = _UI_FILES[name]
        return Response((UI_DIR / fname).read_bytes(), media_type=media, headers={"Cache-Control": "no-cache"})
