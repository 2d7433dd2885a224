"""Expert-tier statistics: per-layer counters, derived rates, and a table a person can read."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass
class LayerCounters:
    lookups: int = 0            # experts requested by the model
    hits_device: int = 0        # served from the device (VRAM) tier
    hits_host: int = 0          # served from the host (RAM) tier
    misses: int = 0             # demand reads from the store
    bytes_read: int = 0         # all store reads, demand and prefetch
    read_time_s: float = 0.0    # sum of store reads' service times (submit -> completion; they overlap)
    stall_time_s: float = 0.0   # compute waiting for reads or copies
    prefetch_issued: int = 0
    prefetch_useful: int = 0    # prefetched, then asked for by the model
    prefetch_wasted: int = 0    # prefetched, then evicted unused
    h2d_copies: int = 0

    def add(self, other: "LayerCounters") -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


def _derived(c: LayerCounters) -> dict:
    d = asdict(c)
    hits = c.hits_device + c.hits_host
    d["hit_rate"] = hits / c.lookups if c.lookups else 0.0
    d["prefetch_precision"] = c.prefetch_useful / c.prefetch_issued if c.prefetch_issued else 0.0
    # Of the lookups that would have missed without prefetch, how many did it save?
    d["prefetch_recall"] = c.prefetch_useful / (c.prefetch_useful + c.misses) if (c.prefetch_useful + c.misses) else 0.0
    d["read_gbps"] = c.bytes_read / c.read_time_s / 1e9 if c.read_time_s else 0.0
    return d


class TierStats:
    def __init__(self, layers):
        self.layers = {l: LayerCounters() for l in layers}
        self.tokens = 0

    def reset(self) -> None:
        for l in self.layers:
            self.layers[l] = LayerCounters()
        self.tokens = 0

    def total(self) -> LayerCounters:
        t = LayerCounters()
        for c in self.layers.values():
            t.add(c)
        return t

    def snapshot(self) -> dict:
        """A plain dict: {"total": {...}, "layers": {layer_idx: {...}}, "tokens": n}."""
        return {"total": _derived(self.total()), "layers": {l: _derived(c) for l, c in self.layers.items()},
                "tokens": self.tokens}

    def table(self, per_layer: bool = False) -> str:
        cols = ("lookups", "hit%", "dev hit", "host hit", "miss", "read MiB", "read s", "stall s",
                "pf issued", "pf prec", "pf recall", "wasted")

        def row(name, c: LayerCounters) -> list:
            d = _derived(c)
            return [name, c.lookups, f"{100 * d['hit_rate']:.1f}", c.hits_device, c.hits_host, c.misses,
                    f"{c.bytes_read / 2**20:.1f}", f"{c.read_time_s:.3f}", f"{c.stall_time_s:.3f}",
                    c.prefetch_issued, f"{d['prefetch_precision']:.2f}", f"{d['prefetch_recall']:.2f}",
                    c.prefetch_wasted]

        rows = [row(f"layer {l}", c) for l, c in self.layers.items()] if per_layer else []
        rows.append(row("total", self.total()))
        header = ["tier"] + list(cols)
        widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
        lines = ["  ".join(str(x).rjust(w) for x, w in zip(r, widths)) for r in [header] + rows]
        if self.tokens:
            t = self.total()
            lines.append(f"tokens: {self.tokens}   read per token: {t.bytes_read / self.tokens / 2**20:.2f} MiB   "
                         f"stall per token: {1e3 * t.stall_time_s / self.tokens:.2f} ms")
        return "\n".join(lines)
