"""The pieces behind metrics and events, without a mount: histograms, namespaces, reader queues."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from kvfs.errors import ConfigError
from kvfs.events import EventHub
from kvfs.metrics import parse_address
from kvfs.telemetry import MAX_NAMESPACES, OTHER, Histogram, Telemetry, namespace_of


def test_histogram_buckets_are_cumulative_and_inclusive():
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 2.0):
        h.observe(v)
    snap = h.snapshot()
    assert snap["buckets"] == [["0.1", 2], ["1.0", 3], ["+Inf", 4]]
    assert snap["count"] == 4 and snap["sum"] == pytest.approx(2.65)


def test_namespaces_follow_adopt_forget_and_renames():
    t = Telemetry()
    assert namespace_of("/a/b/c") == "a" and namespace_of("/c") == "/" and namespace_of("a/b") == "a"
    t.adopt(100, "/m1/ab/x.kv")
    t.adopt(50, "/top.bin")
    t.hit("/m1/ab/x.kv")
    t.miss("/m1/")
    t.rekey(100, "/m1/ab/x.kv", "/m2/ab/x.kv")
    snap = t.snapshot()["namespaces"]
    assert snap["m1"] == {"bytes": 0, "blocks": 0, "hits": 1, "misses": 1}
    assert snap["m2"]["bytes"] == 100 and snap["/"]["blocks"] == 1
    t.forget(100, "/m2/ab/x.kv")
    assert t.snapshot()["namespaces"]["m2"]["blocks"] == 0


def test_namespace_labels_are_bounded():
    t = Telemetry()
    for i in range(MAX_NAMESPACES + 10):
        t.miss(f"/ns{i}/")
    snap = t.snapshot()["namespaces"]
    assert len(snap) == MAX_NAMESPACES + 1 and snap[OTHER]["misses"] == 10


def _obj(size=10, key="/ns/f"):
    return SimpleNamespace(oid=1, size=size, key=key)


def test_a_reader_that_falls_behind_gets_a_dropped_count():
    hub = EventHub()
    hub.queue_limit = 3
    hub.emit("stored", _obj(), "ram")              # nobody listens: counted, not queued
    sub = hub.subscribe()
    for i in range(5):
        hub.emit("stored", _obj(key=f"/ns/f{i}"), "ram")
    lines = [json.loads(x) for x in sub.take(1 << 16).splitlines()]
    assert lines[0]["event"] == "dropped" and lines[0]["count"] == 2
    assert [e["path"] for e in lines[1:]] == ["/ns/f2", "/ns/f3", "/ns/f4"]
    assert not sub.ready()
    assert hub.statistics()["emitted"]["stored"] == 6 and hub.statistics()["dropped"] == 2
    hub.emit("stored", _obj(size=0), "ram")        # empty files make no events
    assert not sub.ready()


def test_short_reads_get_whole_lines_then_the_rest():
    hub = EventHub()
    sub = hub.subscribe()
    hub.emit("demoted", _obj(), "nvme")
    hub.emit("evicted", _obj(), None)
    first = sub.take(40)                            # shorter than one line: a piece of it
    rest = b""
    while sub.ready():
        rest += sub.take(1 << 16)
    lines = (first + rest).splitlines()
    assert [json.loads(x)["event"] for x in lines] == ["demoted", "evicted"]
    hub.unsubscribe(sub)
    assert sub.closed and not hub.active


@pytest.mark.parametrize("text,want", [("9108", ("127.0.0.1", 9108)), ("0.0.0.0:9108", ("0.0.0.0", 9108)),
                                       ("[::1]:0", ("::1", 0)), (":9108", ("0.0.0.0", 9108))])
def test_metrics_addresses(text, want):
    assert parse_address(text) == want


@pytest.mark.parametrize("text", ["host:port", "1:70000", "x"])
def test_bad_metrics_addresses(text):
    with pytest.raises(ConfigError):
        parse_address(text)
