"""Prometheus metrics of a running daemon (``kvfs mount --metrics ADDR:PORT``).

prometheus-client's exposition answers ``/metrics`` on a bounded HTTP server of our own
(kvfs.metrics_http: a fixed pool of threads, idle connections closed). Nothing is added to the
filesystem's hot paths for it: at each scrape the collector asks the trio thread for one
snapshot of the counters the store keeps anyway (``.kvfs/stats``, kvfs.telemetry) and turns
it into metric families on the HTTP thread. Names follow the Prometheus conventions: a
``kvfs_`` prefix, base units (bytes, seconds), ``_total`` on counters. The full list is in
docs/operations.md ("Metrics").
"""
from __future__ import annotations

import logging

import trio
from prometheus_client import CollectorRegistry, ProcessCollector, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from kvfs.errors import ConfigError
from kvfs.metrics_http import BoundedServer

log = logging.getLogger(__name__)

# counters of each tier (TierCounters, .kvfs/stats) -> metric name and help
TIER_COUNTERS = {
    "hits": ("kvfs_tier_hits", "Opens served by this tier (the highest tier holding the file)."),
    "misses": ("kvfs_tier_misses", "Opens of files this tier did not hold (served from below)."),
    "bytes_read": ("kvfs_tier_read_bytes", "Bytes read from this tier."),
    "bytes_written": ("kvfs_tier_written_bytes", "Bytes written to this tier."),
    "demotions": ("kvfs_tier_demotions", "Objects moved off this tier to a lower one."),
    "promotions": ("kvfs_tier_promotions", "Objects copied from this tier up to RAM."),
    "evictions": ("kvfs_tier_evictions", "Objects dropped from the cache while on this tier."),
    "checksum_failures": ("kvfs_tier_checksum_failures", "Reads from this tier that failed their checksum."),
    "errors": ("kvfs_tier_errors", "Reads from this tier that failed (tier unavailable)."),
}
LATENCY_NAMES = {"lookup": "lookup", "lease": "lease", "read": "fuse_read", "write": "fuse_write",
                 "seal": "seal"}
REMOTE_STATES = ("connected", "disconnected", "changed", "refused", "closed")


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT``, ``[V6]:PORT`` or ``PORT`` (then 127.0.0.1); port 0 picks a free one."""
    s = str(text).strip()
    host, sep, port = s.rpartition(":")
    if not sep:
        host, port = "127.0.0.1", s
    host = host.strip("[]") or "0.0.0.0"
    try:
        n = int(port)
    except ValueError:
        raise ConfigError(f"metrics address must be HOST:PORT, not {text!r}") from None
    if not 0 <= n <= 65535:
        raise ConfigError(f"metrics port out of range: {text!r}")
    return host, n


def snapshot(kvstore) -> dict:
    """Everything a scrape reports (``kvstore``: the kvfs.store.store.Store), taken on the trio
    thread (cheap: no per-object walk)."""
    store = kvstore.store
    doc = kvstore.statistics()
    doc["telemetry"] = store.telemetry.snapshot()
    quotas = getattr(kvstore, "quotas", None)
    doc["quotas"] = quotas.statistics() if quotas is not None else {"limits": {}, "evicted": 0, "refused": 0}
    doc["queues"] = {
        **store.queues(),
        "writers": len(kvstore.files.writers),
        "demotion_backlog": {t.name: max(0, int(t.used - store.policy.target(t))) for t in store.tiers},
    }
    return doc


class KvfsCollector:
    """A prometheus-client collector over :func:`snapshot` (taken through ``trio_token``)."""

    def __init__(self, store, trio_token):
        self.store = store
        self.token = trio_token

    def collect(self):
        try:
            doc = trio.from_thread.run_sync(snapshot, self.store, trio_token=self.token)
        except (trio.RunFinishedError, RuntimeError) as e:     # shutting down
            log.debug("no metrics snapshot: %s", e)
            return
        yield from tier_families(doc["tiers"], doc["telemetry"])
        yield from namespace_families(doc["telemetry"]["namespaces"])
        yield from latency_families(doc["telemetry"]["latency"])
        yield from state_families(doc)
        yield from quota_families(doc["quotas"])


def _gauge(name, doc, labels=(), samples=()):
    g = GaugeMetricFamily(name, doc, labels=list(labels))
    for values, v in samples:
        g.add_metric(list(values), v)
    return g


def _counter(name, doc, labels=(), samples=()):
    c = CounterMetricFamily(name, doc, labels=list(labels))
    for values, v in samples:
        c.add_metric(list(values), v)
    return c


def tier_families(tiers: dict, tel: dict):
    rows = list(tiers.items())
    yield _gauge("kvfs_tier_capacity_bytes", "Capacity budget of the tier.", ["tier"],
                 [((n,), t["capacity"]) for n, t in rows])
    yield _gauge("kvfs_tier_used_bytes", "Bytes the tier holds (its footprint).", ["tier"],
                 [((n,), t["used"]) for n, t in rows])
    yield _gauge("kvfs_tier_objects", "Objects (file versions) the tier holds.", ["tier"],
                 [((n,), t["objects"]) for n, t in rows])
    yield _gauge("kvfs_tier_available", "1 while the tier can be reached.", ["tier"],
                 [((n,), 1 if t["available"] else 0) for n, t in rows])
    for key, (name, doc) in TIER_COUNTERS.items():
        yield _counter(name, doc, ["tier"], [((n,), t.get(key, 0)) for n, t in rows])
    yield _counter("kvfs_tier_admission_dropped", "Objects dropped instead of demoted to this tier "
                   "(fewer uses than its admit_after).", ["tier"],
                   [((n,), tel["admission_dropped"].get(n, 0)) for n, _ in rows])
    yield _counter("kvfs_tier_read_deadline_exceeded", "Reads from this tier that ran past "
                   "read_deadline (answered EIO).", ["tier"],
                   [((n,), tel["deadline_exceeded"].get(n, 0)) for n, _ in rows])
    remote = [(n, t) for n, t in rows if "state" in t]
    if remote:
        yield _gauge("kvfs_remote_state", "1 for the current connection state of a remote tier.",
                     ["tier", "state"],
                     [((n, s), 1 if t["state"] == s else 0) for n, t in remote for s in REMOTE_STATES])
        yield _gauge("kvfs_remote_connected", "1 while the remote tier is connected.", ["tier"],
                     [((n,), 1 if t["state"] == "connected" else 0) for n, t in remote])
        yield _counter("kvfs_remote_reconnects", "Reconnections to the remote target.", ["tier"],
                       [((n,), t.get("reconnects", 0)) for n, t in remote])


def namespace_families(nss: dict):
    rows = sorted(nss.items())
    yield _gauge("kvfs_namespace_bytes", "Bytes of the files in a namespace (top-level directory).",
                 ["namespace"], [((n,), c["bytes"]) for n, c in rows])
    yield _gauge("kvfs_namespace_blocks", "Files (blocks) in a namespace.", ["namespace"],
                 [((n,), c["blocks"]) for n, c in rows])
    yield _counter("kvfs_namespace_hits", "Opens and leases of files in a namespace.", ["namespace"],
                   [((n,), c["hits"]) for n, c in rows])
    yield _counter("kvfs_namespace_misses", "Names looked up and not found in a namespace (FUSE "
                   "lookups, .kvfs/lookup and .kvfs/lease past the prefix).", ["namespace"],
                   [((n,), c["misses"]) for n, c in rows])


def latency_families(lat: dict):
    for key, name in LATENCY_NAMES.items():
        h = lat[key]
        fam = HistogramMetricFamily(f"kvfs_{name}_duration_seconds",
                                    f"Time the daemon spent on {name.replace('_', ' ')} requests.")
        fam.add_metric([], buckets=[(le, n) for le, n in h["buckets"]], sum_value=h["sum"])
        yield fam


def state_families(doc: dict):
    q = doc["queues"]
    ev = doc["telemetry"]["events"]
    yield _gauge("kvfs_inodes", "Inodes (files, directories, links).", samples=[((), doc["inodes"])])
    yield _gauge("kvfs_objects", "Sealed objects (file versions).", samples=[((), doc["objects"])])
    yield _gauge("kvfs_open_handles", "Open file descriptors on the mount.", samples=[((), doc["open_handles"])])
    yield _gauge("kvfs_leases", "Live fast-path leases.", samples=[((), doc["leases"])])
    yield _gauge("kvfs_writer_backlog_files", "Files being written (buffers not yet sealed).",
                 samples=[((), q["writers"])])
    yield _gauge("kvfs_promotion_queue_length", "Objects queued for promotion to RAM.",
                 samples=[((), q["promotion"])])
    yield _gauge("kvfs_moves_running", "Demotion/eviction and promotion passes running.",
                 samples=[((), q["moving"])])
    yield _gauge("kvfs_demotion_backlog_bytes", "Bytes above the tier's low watermark (what the "
                 "next pressure pass moves down).", ["tier"],
                 [((n,), v) for n, v in q["demotion_backlog"].items()])
    yield _gauge("kvfs_settled", "1 when no demotion, eviction or promotion is running or queued.",
                 samples=[((), 1 if doc["settled"] else 0)])
    yield _gauge("kvfs_event_readers", "Open readers of .kvfs/events.", samples=[((), ev["readers"])])
    yield _counter("kvfs_events", "KV events emitted (stored, promoted, demoted, evicted, removed).",
                   ["event"], [((k,), v) for k, v in ev["emitted"].items()])
    yield _counter("kvfs_events_dropped", "Events lost by readers that fell behind.",
                   samples=[((), ev["dropped"])])


def quota_families(q: dict):
    yield _gauge("kvfs_namespace_quota_bytes", "Byte quota of a namespace (kvfs quota set).",
                 ["namespace"], [((n,), row["limit"]) for n, row in q["limits"].items()])
    yield _gauge("kvfs_namespace_held_bytes",
                 "Bytes of a namespace's removed files still held open or leased (charged to its quota).",
                 ["namespace"], [((n,), row.get("held", 0)) for n, row in q["limits"].items()])
    yield _counter("kvfs_quota_evictions", "Files evicted to keep a namespace within its quota.",
                   samples=[((), q["evicted"])])
    yield _counter("kvfs_quota_refused_writes", "Writes refused with EDQUOT.", samples=[((), q["refused"])])


class MetricsServer:
    """The HTTP endpoint; ``address`` is where it listens (the real port when 0 was asked)."""

    def __init__(self, address: str, store, trio_token):
        host, port = parse_address(address)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(KvfsCollector(store, trio_token))
        ProcessCollector(registry=self.registry)
        try:
            self.httpd = BoundedServer(host, port, make_wsgi_app(self.registry))
        except OSError as e:
            raise ConfigError(f"cannot serve metrics on {address}: {e.strerror or e}") from None
        self.httpd.start()
        h, p = self.httpd.server_address[:2]
        self.address = f"[{h}]:{p}" if ":" in h else f"{h}:{p}"
        log.info("serving Prometheus metrics on http://%s/metrics", self.address)

    def close(self) -> None:
        self.httpd.stop()
