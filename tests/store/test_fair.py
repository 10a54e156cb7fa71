"""Fair victim choice between namespaces (kvfs/store/fair.py), without the kernel: the
ranking by bytes / weight, quota weights, stale heap entries, and a namespace moving."""
from __future__ import annotations

import contextlib

from kvfs.store.fair import Shares, TierLRU
from kvfs.store.objects import Obj

MB = 1 << 20


def obj(oid: int, path: str, size: int = MB) -> Obj:
    return Obj(oid, size, 0, size, (), {}, oid, path)


def order(lru: TierLRU) -> list[str]:
    with contextlib.closing(lru.ranked()) as it:
        return [ns for ns, _ in it]


def test_without_quotas_the_namespace_holding_most_goes_first():
    lru = TierLRU(Shares(lambda: 100 * MB))
    for i in range(3):
        lru.add(obj(i, f"/small/b{i}"))
    for i in range(10, 20):
        lru.add(obj(i, f"/big/b{i}"))
    lru.add(obj(30, "/top"))                         # a file at the root: namespace "/"
    assert order(lru) == ["big", "small", "/"]
    assert order(lru) == ["big", "small", "/"]       # ranking does not consume the heap
    with contextlib.closing(lru.ranked()) as it:
        ns, lst = next(it)
        assert list(lst) == list(range(10, 20))      # least recently used first
    lru.touch(obj(10, "/big/b10"))
    assert lru.objects("big")[0] == 11 and lru.objects("big")[-1] == 10
    for i in range(10, 18):                          # big shrinks below small
        lru.discard(obj(i, f"/big/b{i}"))
    assert order(lru) == ["small", "big", "/"]
    assert lru.used == {"small": 3 * MB, "big": 2 * MB, "/": MB}
    assert len(lru) == 6 and 18 in lru and 10 not in lru


def test_quotas_weigh_the_share():
    shares = Shares(lambda: 100 * MB)
    lru = TierLRU(shares)
    for i in range(8):                               # a: 8 MB within a 40 MB quota (ratio 0.2)
        lru.add(obj(i, f"/a/b{i}"))
    for i in range(10, 14):                          # b: 4 MB within a 10 MB quota (0.4)
        lru.add(obj(i, f"/b/b{i}"))
    for i in range(20, 26):                          # c: no quota, 6 MB of the 50 MB left (0.12)
        lru.add(obj(i, f"/c/b{i}"))
    assert order(lru) == ["a", "c", "b"]             # no quotas: by bytes
    shares.set_quotas({"a": 40 * MB, "b": 10 * MB})
    assert order(lru) == ["b", "a", "c"]
    shares.set_quotas({"a": 40 * MB, "b": 10 * MB, "c": 100 * MB})
    assert order(lru) == ["b", "a", "c"]
    shares.set_quotas({})
    assert order(lru) == ["a", "c", "b"]


def test_quotas_past_the_capacity_still_give_the_others_an_equal_split():
    shares = Shares(lambda: 10 * MB)
    shares.set_quotas({"a": 100 * MB})               # oversubscribed: nothing is left
    lru = TierLRU(shares)
    for i in range(5):
        lru.add(obj(i, f"/a/b{i}"))                  # 5 MB / 100 MB
    lru.add(obj(10, "/c/b"))                         # 1 MB / (10 MB / 2 namespaces)
    assert order(lru) == ["c", "a"]


def test_the_heap_stays_bounded_and_a_renamed_object_changes_namespace():
    lru = TierLRU(Shares(lambda: MB))
    o = obj(1, "/x/f", 10)
    lru.add(o)
    for i in range(2, 2000):                         # many changes: stale entries are dropped
        lru.add(obj(i, f"/y/f{i}", 1))
        lru.discard(obj(i, f"/y/f{i}", 1))
    assert len(lru._heap) <= 2 * len(lru.used) + 64
    assert order(lru) == ["x"]
    lru.discard(o)
    o.key = "/z/f"
    lru.add(o)
    assert order(lru) == ["z"] and lru.used == {"z": 10}
