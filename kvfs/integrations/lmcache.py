"""LMCache L2 adapter on a kvfs mount (LMCache's ``plugin`` L2 adapter mechanism).

Start the LMCache server with (see docs/integrations.md, tested as written)::

    lmcache server --l1-size-gb 32 --l2-adapter '{"type": "plugin",
        "module_path": "kvfs.integrations.lmcache", "class_name": "KvfsL2Adapter",
        "adapter_params": {"base_path": "/mnt/kvfs/lmcache"}}'

LMCache's plugin adapter imports ``module_path``, finds ``KvfsL2AdapterConfig`` beside
``KvfsL2Adapter`` by its naming convention and builds it from ``adapter_params``.

Files are LMCache's own ``fs`` L2 adapter's (its released ``_object_key_to_filename``: model,
KV rank, object group, chunk hash and cache salt in the name, the object's raw bytes inside),
flat in ``base_path``: an ``fs`` adapter and this one can share a directory. How it talks to
the mount:

* ``submit_lookup_and_lock_task``: **one** ``.kvfs/lease`` request for the batch, on a lease
  descriptor of the task's own: it answers how many leading objects exist *and* pins them
  (the daemon keeps them where they are, their backing files valid) until
  ``submit_unlock`` -- a lookup_and_lock in one round trip. The answer is the leading run of
  present objects (objects past the first missing one are reported missing).
* ``submit_load_task``: locked objects are read from their pinned backing files beside FUSE
  (no further round trip) straight into the L1 objects and their xxh3 checked, a large task
  in parts on ``n_threads`` reader threads; an object without a fast path is read through
  the mount (a lease fallback); unlocked objects are leased by the load itself. Each object
  is a bit of its own: a missing or damaged one does not fail the others.
* ``submit_store_task``: through the mount (temp file + rename), after one lookup that skips
  the leading objects already present.

Every kvfs failure (daemon killed, unmounted, a vanished or damaged object) is a miss (a
0 bit) or a failed store task, never an exception in LMCache's controller threads; tasks
run on a thread pool of the adapter. Counters: ``statistics()`` and ``report_status()``.
"""
from __future__ import annotations

import collections
import concurrent.futures
import itertools
import logging
import os
import threading
from typing import Any

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.distributed.l2_adapters.fs_l2_adapter import _object_key_to_filename
from lmcache.v1.platform import create_event_notifier

from kvfs.integrations.pages import LeaseHold, PageStore, PageStoreStats

log = logging.getLogger(__name__)


class KvfsL2AdapterConfig(L2AdapterConfigBase):
    """``adapter_params`` of the kvfs L2 adapter."""

    _FIELDS = {"base_path": str, "require_kvfs": bool, "lease_ttl": (int, float), "verify_shm": str,
               "stall_timeout": (int, float), "n_threads": int}

    def __init__(self, base_path: str, require_kvfs: bool = True, lease_ttl: float | None = None,
                 verify_shm: str = "once", stall_timeout: float = 10.0, n_threads: int = 4):
        self.base_path = base_path
        self.require_kvfs = require_kvfs
        self.lease_ttl = lease_ttl
        self.verify_shm = verify_shm
        self.stall_timeout = stall_timeout
        self.n_threads = n_threads

    @classmethod
    def from_dict(cls, d: dict) -> "KvfsL2AdapterConfig":
        unknown = set(d) - set(cls._FIELDS)
        if unknown:
            raise ValueError(f"kvfs L2 adapter: unknown adapter_params {sorted(unknown)}")
        if not isinstance(d.get("base_path"), str) or not d["base_path"]:
            raise ValueError("kvfs L2 adapter: base_path must be a non-empty string")
        for k, t in cls._FIELDS.items():
            if k in d and d[k] is not None and (not isinstance(d[k], t) or isinstance(d[k], bool) != (t is bool)):
                raise ValueError(f"kvfs L2 adapter: {k} must be {getattr(t, '__name__', 'a number')}")
        if d.get("verify_shm", "once") not in ("once", "always"):
            raise ValueError("kvfs L2 adapter: verify_shm must be 'once' or 'always'")
        if int(d.get("n_threads", 4)) < 1:
            raise ValueError("kvfs L2 adapter: n_threads must be at least 1")
        return cls(**d)

    @classmethod
    def help(cls) -> str:
        return ("kvfs L2 adapter (type plugin, module_path kvfs.integrations.lmcache, class_name KvfsL2Adapter) "
                "adapter_params:\n- base_path (str, required): a directory on a kvfs mount\n"
                "- require_kvfs (bool, default true)\n- lease_ttl (seconds)\n- verify_shm ('once'|'always')\n"
                "- stall_timeout (seconds, default 10; 0 disables)\n- n_threads (int, default 4)")


class KvfsL2Adapter(L2AdapterInterface):
    """LMCache ``L2AdapterInterface`` over a directory of a kvfs mount."""

    def __init__(self, config: KvfsL2AdapterConfig | dict, l1_memory_desc: Any = None):
        super().__init__()
        if isinstance(config, dict):
            config = KvfsL2AdapterConfig.from_dict(config)
        self.config = config
        self.store = PageStore(config.base_path, require_kvfs=config.require_kvfs,
                               lease_ttl=float(config.lease_ttl) if config.lease_ttl else None,
                               verify_shm=config.verify_shm, stall_timeout=float(config.stall_timeout) or None)
        self._efd = {k: create_event_notifier() for k in ("store", "lookup", "load")}
        self._done: dict[str, dict] = {"store": {}, "lookup": {}, "load": {}}
        self._n_threads = max(1, int(config.n_threads))
        self._pool = concurrent.futures.ThreadPoolExecutor(self._n_threads, "kvfs_lmcache")
        self._readers = concurrent.futures.ThreadPoolExecutor(self._n_threads, "kvfs_lmcache_read")
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._locks: dict[Any, collections.deque] = {}     # key -> holds pinning it (one per lock)
        self._refs: dict[int, int] = {}                     # id(hold) -> keys still locked in it
        self._closed = False
        log.info("kvfs LMCache L2 adapter at %s", self.store.dir)

    # -- event fds ---------------------------------------------------------------------------
    def get_store_event_fd(self) -> int:
        return self._efd["store"].fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._efd["lookup"].fileno()

    def get_load_event_fd(self) -> int:
        return self._efd["load"].fileno()

    def _submit(self, kind: str, fn, fail) -> L2TaskId:
        """Run ``fn()`` on the pool; its result (``fail`` if it raised, or could not run)
        completes task ``kind`` and signals that kind's event fd."""
        tid = next(self._ids)

        def run() -> None:
            try:
                result = fn()
            except Exception:          # noqa: BLE001 -- never into LMCache: the task just fails
                log.exception("kvfs L2 adapter: %s task %d failed", kind, tid)
                result = fail
            with self._lock:
                self._done[kind][tid] = result
            self._efd[kind].notify()
        try:
            self._pool.submit(run)
        except RuntimeError:           # closed
            with self._lock:
                self._done[kind][tid] = fail
            self._efd[kind].notify()
        return tid

    # -- store -------------------------------------------------------------------------------
    def submit_store_task(self, keys: list, objects: list) -> L2TaskId:
        keys, objects = list(keys), list(objects)

        def store() -> L2StoreResult:
            names = [_object_key_to_filename(k) for k in keys]
            ok = self.store.write_many(names, lambda i: [objects[i].byte_array])
            sizes = [len(o.byte_array) for o in objects]
            stored = [i for i, good in enumerate(ok) if good]
            if stored:
                self._notify_keys_stored([keys[i] for i in stored], [sizes[i] for i in stored])
            return L2StoreResult(all(ok), sum(sizes[i] for i in stored))
        return self._submit("store", store, L2StoreResult(False, 0))

    def pop_completed_store_tasks(self) -> dict:
        with self._lock:
            done, self._done["store"] = self._done["store"], {}
        return done

    # -- lookup and lock ---------------------------------------------------------------------
    def submit_lookup_and_lock_task(self, keys: list, group_layout_descs: dict) -> L2TaskId:
        keys = list(keys)

        def lookup() -> Bitmap:
            bitmap = Bitmap(len(keys))
            k, held = self.store.hold([_object_key_to_filename(key) for key in keys])
            if held is not None and k == 0:
                self.store.release_hold(held)
            elif held is not None:
                with self._lock:
                    self._refs[id(held)] = k
                    for key in keys[:k]:
                        self._locks.setdefault(key, collections.deque()).append(held)
            for i in range(k):
                bitmap.set(i)
            return bitmap
        return self._submit("lookup", lookup, Bitmap(len(keys)))

    def query_lookup_and_lock_result(self, task_id: L2TaskId):
        with self._lock:
            return self._done["lookup"].pop(task_id, None)

    def submit_unlock(self, keys: list) -> None:
        """Unpin ``keys`` (one lock each); a hold whose keys are all unlocked gives its lease
        back. Never fails: a lease the daemon cannot be told about ends with its ttl."""
        free: list[LeaseHold] = []
        with self._lock:
            for key in keys:
                q = self._locks.get(key)
                if not q:
                    continue
                held = q.popleft()
                if not q:
                    del self._locks[key]
                self._refs[id(held)] -= 1
                if self._refs[id(held)] == 0:
                    del self._refs[id(held)]
                    free.append(held)
        for held in free:
            try:
                self._pool.submit(self.store.release_hold, held)
            except RuntimeError:       # closed: release here
                self.store.release_hold(held)

    # -- load --------------------------------------------------------------------------------
    def submit_load_task(self, keys: list, objects: list) -> L2TaskId:
        keys, objects = list(keys), list(objects)

        def load() -> Bitmap:
            names = [_object_key_to_filename(k) for k in keys]
            with self._lock:
                holds = [self._locks[k][0] if self._locks.get(k) else None for k in keys]
            dests = [[memoryview(o.byte_array).cast("B")] for o in objects]
            ok = [False] * len(keys)
            by_hold: dict[int, list[int]] = {}
            for i, h in enumerate(holds):
                by_hold.setdefault(id(h), []).append(i)
            for idxs in by_hold.values():
                held, own = holds[idxs[0]], None
                if held is None:       # not locked: a lease of the load's own, for the load
                    own = held = self.store.hold([names[i] for i in idxs])[1]
                try:
                    got = self._read_parts(held, [names[i] for i in idxs], [dests[i] for i in idxs])
                finally:
                    self.store.release_hold(own)
                for i, g in zip(idxs, got):
                    ok[i] = g
            bitmap = Bitmap(len(keys))
            for i, g in enumerate(ok):
                if g:
                    bitmap.set(i)
            loaded = [k for k, g in zip(keys, ok) if g]
            if loaded:
                self._notify_keys_accessed(loaded)
            return bitmap
        return self._submit("load", load, Bitmap(len(keys)))

    def _read_parts(self, held: LeaseHold | None, names: list[str], dests: list) -> list[bool]:
        """Read one hold's objects (each on its own: a missing one is a 0 bit) in up to
        ``n_threads`` parts at once (at least 16 objects a part): a prefetch is one load task
        of every object of a request, and one thread would read and hash them one by one."""
        n = len(names)
        parts = min(self._n_threads, max(1, n // 16))
        step = -(-n // parts)
        spans = [(i, min(i + step, n)) for i in range(0, n, step)]

        def read(a: int, b: int) -> list[bool]:
            return self.store.read_held(held, names[a:b], dests[a:b])
        if len(spans) == 1:
            return read(0, n)
        try:
            futs = [self._readers.submit(read, a, b) for a, b in spans]
        except RuntimeError:           # closing: read here
            return read(0, n)
        return [g for f in futs for g in f.result()]

    def query_load_result(self, task_id: L2TaskId):
        with self._lock:
            return self._done["load"].pop(task_id, None)

    # -- eviction, status, counters, cleanup ---------------------------------------------------
    def delete(self, keys: list) -> None:
        gone, sizes = [], []
        for key in keys:
            path = os.path.join(self.store.dir, _object_key_to_filename(key))
            try:
                size = os.stat(path).st_size
                os.unlink(path)
            except OSError:            # absent, or kvfs gone: nothing deleted
                continue
            gone.append(key)
            sizes.append(size)
        if gone:
            self._notify_keys_deleted(gone, sizes)

    def statistics(self) -> PageStoreStats:
        """kvfs counters: lookups, hits, misses, bytes, lease fallbacks, errors, ..."""
        return self.store.statistics()

    def report_status(self) -> dict:
        st = self.statistics()
        return {"is_healthy": self.store.on_kvfs, "type": "KvfsL2Adapter", "base_path": self.store.dir,
                "locked_keys": len(self._locks), **st.__dict__}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=False)
        self._readers.shutdown(wait=True)
        with self._lock:
            holds = {id(h): h for q in self._locks.values() for h in q}
            self._locks.clear()
            self._refs.clear()
        for h in holds.values():
            self.store.release_hold(h)
        self.store.close()
        for e in self._efd.values():
            e.close()
