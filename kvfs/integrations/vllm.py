"""vLLM secondary offloading tier on a kvfs mount (the offloading connector's tiering spec).

Start vLLM with (see docs/integrations.md, tested as written)::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": 17179869184,
            "secondary_tiers": [{"type": "KvfsTierManager",
                                 "module_path": "kvfs.integrations.vllm",
                                 "root_dir": "/mnt/kvfs/vllm"}]}}'

vLLM's ``TieringOffloadingSpec`` keeps a CPU primary tier and cascades every chunk stored
there to its secondary tiers (``submit_store``), and promotes chunks a request needs from a
secondary tier into the primary one (``submit_load``). This tier is vLLM's own ``fs`` tier's
on-disk format -- the same :class:`~vllm.v1.kv_offload.file_mapper.FileMapper` names
(``<root>/<model>_<digest>_r<rank>/<hhh>/<hh>_g<group>/<hash>.bin``, one chunk per file, its
exact bytes, ``config.json`` beside) -- so an ``fs`` tier and this one can share one
directory, and a cache written by either is read by both. What differs is how it talks to
the mount:

* lookups: vLLM asks per chunk and gets RETRY until the tier's lookup thread has answered
  (vLLM's own ``AsyncLookupManager``, which batches a step's keys per request); each batch is
  **one** ``.kvfs/lookup`` round trip (the ``fs`` tier: one ``access`` per chunk). The answer
  is the leading run of present chunks: keys past a request's first missing chunk are
  reported missing (vLLM loads a leading run only). A request's first chunk that the mount's
  name table says is absent is answered MISS at once, in the scheduler's step (no RETRY, no thread hop, no
  system call: ``PageStore.absent_now``), so a new prompt is scheduled a step earlier.
* loads: **one** ``.kvfs/lease`` round trip per job, then each chunk is read from its backing
  file (RAM tier tmpfs, or NVMe with O_DIRECT) beside FUSE straight into the primary tier's
  slot and its xxh3 checked. A chunk without a fast path is read through the mount (counted
  as a lease fallback). A partial load keeps the leading chunks (``successful_keys``) and
  marks the rest a miss, as the ``fs`` tier does.
* stores: through the mount (temp file + rename), after one lookup that skips the leading
  chunks already present.

Tier options (the tier config's keys besides ``type``/``module_path``): ``root_dir``
(required), ``n_read_threads``/``n_write_threads`` (default 4 each), ``require_kvfs``
(default true: a root that is not on a kvfs mount is never written to, every lookup a miss),
``lease_ttl`` (seconds), ``verify_shm`` (``once``/``always``), ``stall_timeout`` (seconds,
default 10; 0 disables), ``enable_kv_events``, ``locality``, ``backpressure``.

Every kvfs failure (daemon killed, unmounted, a vanished or damaged chunk) is a miss or a
failed job, never an exception in vLLM's scheduler or in a thread of this tier. Counters:
``statistics()``.
"""
from __future__ import annotations

import collections
import concurrent.futures
import json
import logging
import os
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, ClassVar

from vllm.v1.kv_offload.base import Locality, LookupResult, Medium, OffloadingEvent, OffloadKey, ReqContext
from vllm.v1.kv_offload.file_mapper import FileMapper
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import (JobId, JobResult, RequestOffloadingContext, ScheduleEndContext,
                                             SecondaryTierManager, TransferJob)

from kvfs.integrations.pages import PageStore, PageStoreStats
from kvfs.kv.lookup import open_mount_root, replace_at

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec

log = logging.getLogger(__name__)


_NAME_CACHE = 1 << 16      # chunk names remembered (the lookup thread names a batch while holding the GIL)


class _KvfsLookup(AsyncLookupManager):
    """vLLM's asynchronous lookup state machine; each batch is one ``.kvfs/lookup`` call."""

    def __init__(self, tier: "KvfsTierManager", tier_type: str):
        self._tier = tier            # set before the base class starts its worker thread
        super().__init__(tier_type=tier_type)

    def unasked(self, key: OffloadKey) -> bool:
        """No lookup of ``key`` pending or answered here (vLLM's own state; a version without
        that attribute: always True)."""
        states = getattr(self, "_lookup_state", None)
        return states is None or key not in states

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        # one lookup request: its wait releases the GIL that vLLM's scheduler thread needs
        # (probing the name table for every key would hold it for the whole batch)
        k = self._tier.store.prefix([self._tier.name(key) for key in keys], table_hits=False)
        return [i < k for i in range(len(keys))]


class _Jobs:
    """Loads and stores on thread pools of their own; finished jobs queue up for the scheduler.
    A job function returns how many of its chunks succeeded (a leading run) and never raises."""

    def __init__(self, n_read: int, n_write: int):
        self._pools = {"load": concurrent.futures.ThreadPoolExecutor(max(1, n_read), "kvfs_vllm_load"),
                       "store": concurrent.futures.ThreadPoolExecutor(max(1, n_write), "kvfs_vllm_store")}
        self._finished: collections.deque = collections.deque()
        self._pending: set[concurrent.futures.Future] = set()
        self._lock = threading.Lock()

    def submit(self, kind: str, job_id: JobId, n: int, fn) -> None:
        t0 = time.monotonic()

        def run() -> int:
            try:
                return fn()
            except Exception:          # noqa: BLE001 -- never into vLLM: the job just fails
                log.exception("kvfs vLLM tier: %s job %s failed", kind, job_id)
                return 0

        def done(f: concurrent.futures.Future) -> None:
            ok = 0 if f.cancelled() else f.result()
            with self._lock:
                self._pending.discard(f)
                self._finished.append((job_id, ok, n, time.monotonic() - t0))

        try:
            fut = self._pools[kind].submit(run)
        except RuntimeError:           # shut down: the job fails, and is still reported
            with self._lock:
                self._finished.append((job_id, 0, n, 0.0))
            return
        with self._lock:
            self._pending.add(fut)
        fut.add_done_callback(done)

    def finished(self) -> list[tuple[JobId, int, int, float]]:
        out = []
        while self._finished:
            out.append(self._finished.popleft())
        return out

    def wait_idle(self) -> None:
        while True:
            with self._lock:
                pending = list(self._pending)
            if not pending:
                return
            concurrent.futures.wait(pending)

    @property
    def busy(self) -> bool:
        """Jobs running, or finished and not yet collected."""
        with self._lock:
            return bool(self._pending or self._finished)

    def shutdown(self) -> None:
        for p in self._pools.values():
            p.shutdown(wait=True, cancel_futures=True)


class KvfsTierManager(SecondaryTierManager):
    """vLLM ``SecondaryTierManager`` over a directory of a kvfs mount, in the ``fs`` tier's
    file layout."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(self, offloading_spec: "OffloadingSpec", primary_kv_view: memoryview, tier_type: str,
                 root_dir: str, n_read_threads: int = 4, n_write_threads: int = 4, require_kvfs: bool = True,
                 lease_ttl: float | None = None, verify_shm: str = "once", stall_timeout: float = 10.0,
                 enable_kv_events: bool = False, locality: str | None = None, backpressure_detector=None):
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = Locality(locality) if locality is not None else None
        self.events: list[OffloadingEvent] | None = None
        if enable_kv_events and offloading_spec.kv_events_config.enable_kv_cache_events:
            self.events = []
        self._flat = primary_kv_view.cast("B") if primary_kv_view.ndim != 1 or primary_kv_view.format != "B" \
            else primary_kv_view
        # the fs tier's names: one chunk per file, parallelism-agnostic where vLLM allows it
        self.file_mapper = FileMapper.from_offloading_spec(
            root_dir=os.fspath(root_dir), offloading_spec=offloading_spec,
            blocks_per_file=offloading_spec.blocks_per_chunk, parallel_agnostic=True)
        self.dir = f"{self.file_mapper.base_path}_r{self.file_mapper.rank}"
        self._prefix = self.dir + "/"
        self.store = PageStore(self.dir, require_kvfs=require_kvfs, lease_ttl=lease_ttl, verify_shm=verify_shm,
                               stall_timeout=float(stall_timeout) or None)
        self._write_config()
        self._load_keys: dict[JobId, list[OffloadKey]] = {}
        self._store_keys: dict[JobId, list[OffloadKey]] = {}
        self._jobs = _Jobs(int(n_read_threads), int(n_write_threads))
        self._lookup = _KvfsLookup(self, tier_type)
        self._asked: set[str] = set()     # requests whose lookups went to the lookup thread
        self._names: dict[OffloadKey, str] = {}     # chunk names (stored, looked up, loaded: each named once)
        log.info("kvfs vLLM tier %r at %s (%d-byte chunks)", tier_type, self.dir, self.block_size_bytes)

    def name(self, key: OffloadKey) -> str:
        """The chunk's file, relative to the rank directory (what the fs tier names it)."""
        name = self._names.get(key)
        if name is None:
            path = self.file_mapper.get_file_name(key)
            if not path.startswith(self._prefix):
                raise ValueError(f"{path} is not under {self.dir}")
            name = path[len(self._prefix):]
            if len(self._names) >= _NAME_CACHE:
                self._names.clear()
            self._names[key] = name
        return name

    def _write_config(self) -> None:
        """``config.json`` beside the chunks, as the fs tier writes it (so either can start
        first); skipped while the root is not on a kvfs mount (``require_kvfs``)."""
        path = self.file_mapper.get_config_file_path()
        if self.store.require_kvfs and not self.store.on_kvfs:
            log.warning("kvfs vLLM tier: %s is not on a kvfs mount: every lookup is a miss", self.dir)
            return
        try:
            self.store.makedirs(os.path.dirname(path))     # through the mount's root (it may be gone)
            root = self.store.mount_root
            # and the file too: through a descriptor of that root, checked through itself (a
            # mount dead since the makedirs fails instead of writing under the bare mount point)
            at = open_mount_root(root) if root is not None else None
            try:
                rel = os.path.relpath(os.path.realpath(path), root) if at is not None else path
                try:
                    os.stat(rel, dir_fd=at)
                except FileNotFoundError:
                    text = json.dumps(self.file_mapper.get_run_config(), indent=2, sort_keys=True)
                    replace_at(at, f"{rel}.{os.urandom(6).hex()}.tmp", rel, text.encode())
            finally:
                if at is not None:
                    os.close(at)
        except OSError as e:
            log.warning("kvfs vLLM tier: cannot write %s (%s)", path, e)

    def _slot(self, chunk_id) -> memoryview:
        off = int(chunk_id) * self.block_size_bytes
        return self._flat[off:off + self.block_size_bytes]

    # -- the tiering manager's calls (scheduler thread, under its lock) --------------------
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if req_context.req_id not in self._asked:   # the request's first chunk only: its later
            if self._lookup.unasked(key) and self.store.absent_now(self.name(key)):   # ones go in its batch
                return LookupResult.MISS    # the name table, in this step: no RETRY, no thread hop
            self._asked.add(req_context.req_id)
        result = self._lookup.lookup(key, req_context)
        if result is None:
            return LookupResult.RETRY
        return LookupResult.HIT if result else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        names = [self.name(k) for k in keys]
        slots = [self._slot(c) for c in job_metadata.chunk_ids]
        if self.events is not None:
            self._store_keys[job_metadata.job_id] = keys

        def store() -> int:
            ok = self.store.write_many(names, lambda i: [slots[i]])
            return len(ok) if all(ok) else 0
        self._jobs.submit("store", job_metadata.job_id, len(keys), store)

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        self._load_keys[job_metadata.job_id] = keys
        names = [self.name(k) for k in keys]
        dests = [[self._slot(c)] for c in job_metadata.chunk_ids]

        def load() -> int:
            ok = self.store.read_into(names, dests)
            return ok.index(False) if False in ok else len(ok)
        self._jobs.submit("load", job_metadata.job_id, len(keys), load)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results = []
        for job_id, n_ok, n, dt in self._jobs.finished():
            success = n_ok == n
            nbytes = n_ok * self.block_size_bytes or None
            load_keys = self._load_keys.pop(job_id, None)
            store_keys = self._store_keys.pop(job_id, None)
            if store_keys and success and self.events is not None:
                self.events.append(OffloadingEvent(keys=store_keys, medium=self.medium, removed=False,
                                                   locality=self.locality))
            kept = None
            if load_keys is not None and not success:
                self._lookup.mark_miss(load_keys[n_ok:])     # not offered again (vLLM #49176)
                kept = tuple(load_keys[:n_ok]) or None
            results.append(JobResult(job_id=job_id, success=success, successful_keys=kept,
                                     transfer_time=dt, transfer_bytes=nbytes))
        return results

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self.events is not None:
            yield from self.events
            self.events.clear()

    def has_pending_work(self) -> bool:
        return self._jobs.busy

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._asked.discard(req_context.req_id)
        self._lookup.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookup.flush()

    def drain_jobs(self) -> None:
        self._jobs.wait_idle()

    def shutdown(self) -> None:
        self._lookup.shutdown()
        self._jobs.shutdown()
        self.store.close()

    # -- counters ---------------------------------------------------------------------------
    def statistics(self) -> PageStoreStats:
        """kvfs counters: lookups, hits, misses, bytes, lease fallbacks, errors, ..."""
        return self.store.statistics()
