"""SGLang HiCache storage backend on a kvfs mount (SGLang's ``dynamic`` storage backend).

Launch SGLang with (see docs/integrations.md, tested as written)::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvfs",
        "module_path": "kvfs.integrations.sglang", "class_name": "KvfsHiCacheStorage",
        "interface_v1": 1, "root": "/mnt/kvfs/sglang"}'

``interface_v1: 1`` makes SGLang's cache controller call ``batch_get_v1``/``batch_set_v1``
with host-pool indices: pages are read from kvfs straight into the host KV pool (no
intermediate page tensor) and written from it. Without it the controller's generic path
(``batch_get``/``batch_set`` with flat page tensors) is used; both are implemented.

Per batch of up to 128 pages (SGLang's ``STORAGE_BATCH_SIZE``): ``batch_exists`` is one
``.kvfs/lookup`` round trip; ``batch_get_v1`` is one ``.kvfs/lease`` round trip plus reads of
the backing files beside FUSE, each page's xxh3 checked; ``batch_set_v1`` writes the missing
pages through the mount (temp file + rename), after one lookup that skips those present.

Layout on the mount::

    <root>/[<namespace>/]<model>/<rank>/<dtype>_<page shape>/<key>.bin

``<rank>`` is ``tp<r>of<n>`` (plus ``_pp``/``_cp``/``_dcp`` parts when used), or ``mla`` for
MLA models (KV replicated across TP ranks: one shared copy, written by SGLang's storage-writer
rank only). ``<page shape>`` is the host pool's page view without unit dimensions, so pools
whose pages are not byte-compatible never share a directory; ``layer_first`` and
``page_first_direct`` pages are byte-identical (``[2, layers, page, heads, dim]``) and do.
A page file holds exactly the bytes of the host pool's flat data page (``get_data_page``) --
what SGLang's own file backend writes. Request namespaces (``cache_salt``, LoRA extra key) are
folded into the page keys by SGLang itself (its storage hash seeds each chain with them);
``namespace`` in the extra config separates tenants or deployments on one mount.

``extra_config`` keys: ``root`` (required, or env ``KVFS_SGLANG_ROOT``), ``namespace``,
``require_kvfs`` (default true: if ``root`` is not on a kvfs mount nothing is read or written
and every lookup is a miss), ``lease_ttl`` (seconds), ``verify_shm`` (``once``/``always``),
``stall_timeout`` (seconds, default 10; 0 disables: see ``PageStore._call``).

Every kvfs failure (daemon killed, unmounted, a vanished or damaged page) is a miss or a failed
store, never an exception in SGLang's prefetch or backup thread. Counters: ``statistics()``.
"""
from __future__ import annotations

import hashlib
import itertools
import logging
import os
import re
import threading
import time
from typing import Any, List, Optional

import torch

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from kvfs.integrations.pages import PageStore, PageStoreStats

log = logging.getLogger(__name__)

ROOT_ENV = "KVFS_SGLANG_ROOT"
_SAFE = re.compile(r"[^A-Za-z0-9._-]+")
_KEY_OK = re.compile(r"^[A-Za-z0-9._-]{1,200}$")
_KV_POOL = "kv"


def _safe(part: str) -> str:
    return _SAFE.sub("-", part).strip("-.") or "_"


def page_name(key: str) -> str:
    """The file name of page ``key`` (hex hashes as they are; anything else hashed)."""
    if not _KEY_OK.match(key) or key.startswith("."):
        key = "h" + hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()
    return key + ".bin"


def rank_dir(cfg: HiCacheStorageConfig) -> str:
    """The directory part that keeps ranks' pages apart (shared for replicated MLA KV)."""
    if cfg.is_mla_model:
        part = "mla"
    else:
        part = f"tp{cfg.tp_rank}of{cfg.tp_size}"
    if cfg.pp_size > 1:
        part += f"_pp{cfg.pp_rank}of{cfg.pp_size}"
    if getattr(cfg, "attn_cp_size", 1) > 1:
        part += f"_cp{cfg.attn_cp_rank}of{cfg.attn_cp_size}"
    if getattr(cfg, "dcp_size", 1) > 1:
        part += f"_dcp{cfg.dcp_rank}of{cfg.dcp_size}_page{cfg.logical_page_size}"
    return part


def _byte_view(t: torch.Tensor) -> memoryview:
    """Writable bytes of a contiguous CPU tensor."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class _Pages:
    """Where each page of a host pool lives: per page, its byte ranges in file order."""

    def __init__(self, pool):
        self.pool = pool
        self.page_size = int(pool.page_size)
        view = pool.get_data_page(0, flat=False)
        if view.device.type != "cpu":
            raise ValueError(f"host pool on {view.device}: kvfs reads into CPU host pools only")
        shape = tuple(s for s in view.shape if s != 1)
        self.tag = f"{str(view.dtype).removeprefix('torch.')}_{'x'.join(map(str, shape))}"
        self.page_bytes = view.numel() * view.element_size()
        storage = view.untyped_storage()
        whole = torch.empty(0, dtype=torch.uint8).set_(storage)
        self.mv = memoryview(whole.numpy())
        self._whole = whole
        starts0, self.seg = self._segments(view)
        self.starts0 = starts0
        self.stride = None
        # pages at linear offsets (every layout SGLang has): one template for all pages
        try:
            n_tokens = int(getattr(pool, "size", 0))
            if n_tokens >= 3 * self.page_size:
                s1, seg1 = self._segments(pool.get_data_page(self.page_size, flat=False))
                s2, seg2 = self._segments(pool.get_data_page(2 * self.page_size, flat=False))
                d = s1[0] - starts0[0]
                if seg1 == seg2 == self.seg and all(b - a == d for a, b in zip(starts0, s1)) \
                        and all(c - b == d for b, c in zip(s1, s2)):
                    self.stride = d
        except (IndexError, RuntimeError, ValueError):
            self.stride = None

    @staticmethod
    def _segments(view: torch.Tensor) -> tuple[list[int], int]:
        """Byte offsets (in the storage) of the maximal contiguous runs of ``view``, in order."""
        shape, strides, e = list(view.shape), list(view.stride()), view.element_size()
        k, expect = len(shape), 1
        while k > 0 and (shape[k - 1] == 1 or strides[k - 1] == expect):
            expect *= shape[k - 1]
            k -= 1
        seg = expect * e
        base = view.storage_offset() * e
        lead = [range(s) for s in shape[:k]]
        starts = [base + sum(i * strides[j] * e for j, i in enumerate(idx)) for idx in itertools.product(*lead)]
        return starts, seg

    def dests(self, index: int) -> list[memoryview]:
        """Page at token ``index`` (a page start): its byte ranges in file order."""
        if self.stride is not None:
            shift = (index // self.page_size) * self.stride
            starts = [s + shift for s in self.starts0]
            seg = self.seg
        else:
            starts, seg = self._segments(self.pool.get_data_page(index, flat=False))
        mv = self.mv
        return [mv[s:s + seg] for s in starts]


class KvfsHiCacheStorage(HiCacheStorage):
    """SGLang ``HiCacheStorage`` over a directory of a kvfs mount."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        extra = dict(storage_config.extra_config or {})
        root = extra.get("root") or os.environ.get(ROOT_ENV)
        if not root:
            raise ValueError(f"kvfs HiCache backend: set 'root' in the extra config (or {ROOT_ENV})")
        self.config = storage_config
        self.root = os.fspath(root)
        parts = []
        if extra.get("namespace"):
            parts.append(_safe(str(extra["namespace"])))
        parts += [_safe(storage_config.model_name or "model"), rank_dir(storage_config)]
        self.base = os.path.join(*parts)
        self.require_kvfs = bool(extra.get("require_kvfs", True))
        self.lease_ttl = float(extra["lease_ttl"]) if extra.get("lease_ttl") else None
        self.stall_timeout = float(extra.get("stall_timeout", 10.0)) or None
        self.verify_shm = str(extra.get("verify_shm", "once"))
        if self.verify_shm not in ("once", "always"):
            raise ValueError(f"kvfs HiCache backend: verify_shm must be 'once' or 'always', got {self.verify_shm!r}")
        self.writer = bool(getattr(storage_config, "is_storage_writer", True))
        self.metrics = bool(storage_config.enable_storage_metrics)
        self._store: PageStore | None = None
        self._pages: _Pages | None = None
        self._plain: dict[int, PageStore] = {}       # legacy path: per page size, before a pool
        self._lock = threading.Lock()
        self._metric_lists = dict(prefetch_pgs=[], backup_pgs=[], prefetch_bandwidth=[], backup_bandwidth=[])
        self._warned_pools = False
        log.info("kvfs HiCache backend at %s/%s", self.root, self.base)

    # -- host pool ------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        pages = _Pages(mem_pool_host)
        store = PageStore(self.root, os.path.join(self.base, pages.tag), require_kvfs=self.require_kvfs,
                          lease_ttl=self.lease_ttl, verify_shm=self.verify_shm,
                          stall_timeout=self.stall_timeout)
        with self._lock:
            old, self._store, self._pages = self._store, store, pages
        if old is not None:
            old.close()
        log.info("kvfs HiCache pages: %s (%d bytes each, %s)", store.dir, pages.page_bytes,
                 "linear" if pages.stride is not None else "per-page views")

    def _store_for(self, nbytes: int) -> PageStore | None:
        """The store of pages of ``nbytes`` bytes (legacy calls may precede a pool)."""
        if self._store is not None and self._pages.page_bytes == nbytes:
            return self._store
        with self._lock:
            st = self._plain.get(nbytes)
            if st is None:
                st = self._plain[nbytes] = PageStore(
                    self.root, os.path.join(self.base, f"raw_{nbytes}"), require_kvfs=self.require_kvfs,
                    lease_ttl=self.lease_ttl, verify_shm=self.verify_shm,
                          stall_timeout=self.stall_timeout)
            return st

    # -- existence ------------------------------------------------------------------------
    def batch_exists(self, keys: List[str], extra_info=None) -> int:
        store = self._store
        if store is None or not keys:
            return 0
        return store.prefix([page_name(k) for k in keys])

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists_v2(self, keys, pool_transfers=None, extra_info=None):
        from sglang.srt.mem_cache.hicache_storage import PoolTransferResult
        if pool_transfers:
            if not self._warned_pools:
                self._warned_pools = True
                log.warning("kvfs HiCache backend stores the KV pool only; pools %s are misses",
                            [str(t.name) for t in pool_transfers])
            return PoolTransferResult(0, {}, [])
        k = self.batch_exists(keys, extra_info)
        return PoolTransferResult(k, {_KV_POOL: k} if k else {}, list(range(1, k + 1)))

    # -- zero-copy interface (extra_config interface_v1: 1) --------------------------------
    def _page_starts(self, keys, host_indices) -> list[int]:
        ps = self._pages.page_size
        idx = host_indices.tolist() if isinstance(host_indices, torch.Tensor) else list(host_indices)
        if len(idx) < len(keys) * ps:
            raise ValueError(f"{len(idx)} host indices for {len(keys)} pages of {ps} tokens")
        return idx[0:len(keys) * ps:ps]

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info=None) -> List[bool]:
        store, pages = self._store, self._pages
        if store is None or not keys:
            return [False] * len(keys)
        t0 = time.perf_counter()
        try:
            dests = [pages.dests(i) for i in self._page_starts(keys, host_indices)]
        except Exception as e:     # noqa: BLE001 -- a bad index is the caller's, still a miss
            log.warning("kvfs HiCache batch_get_v1: bad host indices (%s)", e)
            return [False] * len(keys)
        ok = store.read_into([page_name(k) for k in keys], dests)
        self._metric("prefetch", ok, pages.page_bytes, t0)
        return ok

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info=None) -> List[bool]:
        store, pages = self._store, self._pages
        if store is None or not keys:
            return [False] * len(keys)
        if not self.writer:              # replicated MLA KV: the writer rank stores it
            return [True] * len(keys)
        t0 = time.perf_counter()
        try:
            srcs = [pages.dests(i) for i in self._page_starts(keys, host_indices)]
        except Exception as e:     # noqa: BLE001
            log.warning("kvfs HiCache batch_set_v1: bad host indices (%s)", e)
            return [False] * len(keys)
        ok = store.write_many([page_name(k) for k in keys], srcs.__getitem__)
        self._metric("backup", ok, pages.page_bytes, t0)
        return ok

    # -- generic interface (flat page tensors) --------------------------------------------
    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None):
        got = self.batch_get([key], [target_location])
        return got[0]

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[torch.Tensor | None]:
        if not keys:
            return []
        if target_locations is None or len(target_locations) != len(keys):
            return [None] * len(keys)
        t0 = time.perf_counter()
        try:
            dests = [[_byte_view(t)] for t in target_locations]
            nbytes = len(dests[0][0])
            if any(len(d[0]) != nbytes for d in dests):
                raise ValueError("target pages of different sizes")
        except Exception as e:     # noqa: BLE001 -- not contiguous CPU tensors: cannot fill them
            log.warning("kvfs HiCache batch_get: unusable target tensors (%s)", e)
            return [None] * len(keys)
        store = self._store_for(nbytes)
        ok = store.read_into([page_name(k) for k in keys], dests)
        self._metric("prefetch", ok, nbytes, t0)
        return [t if g else None for t, g in zip(target_locations, ok)]

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        if not keys:
            return True
        if values is None or len(values) != len(keys):
            return False
        if not self.writer:
            return True
        t0 = time.perf_counter()
        try:
            srcs = [[_byte_view(v.contiguous())] for v in values]
            nbytes = len(srcs[0][0])
        except Exception as e:     # noqa: BLE001
            log.warning("kvfs HiCache batch_set: unusable values (%s)", e)
            return False
        store = self._store_for(nbytes)
        ok = store.write_many([page_name(k) for k in keys], srcs.__getitem__)
        self._metric("backup", ok, nbytes, t0)
        return all(ok)

    # -- v2 (pool transfers): the KV pool only --------------------------------------------
    def _v2(self, transfers, op) -> dict:
        out = {}
        for t in transfers:
            keys = list(t.keys or [])
            if str(t.name) == _KV_POOL and self._pages is not None and t.host_indices is not None:
                out[t.name] = op(keys, t.host_indices)
            else:
                out[t.name] = [False] * len(keys)
        return out

    def batch_get_v2(self, transfers, extra_info=None):
        return self._v2(transfers, self.batch_get_v1)

    def batch_set_v2(self, transfers, extra_info=None):
        return self._v2(transfers, self.batch_set_v1)

    # -- maintenance and counters ---------------------------------------------------------
    def clear(self) -> None:
        for st in [self._store, *self._plain.values()]:
            if st is not None:
                st.remove_all()

    def statistics(self) -> PageStoreStats:
        """kvfs counters (hits, misses, bytes, lease fallbacks, ...) summed over the stores."""
        stores = [s for s in [self._store, *self._plain.values()] if s is not None]
        if not stores:
            return PageStoreStats(*([0] * len(PageStoreStats.__dataclass_fields__)))
        stats = [s.statistics() for s in stores]
        return PageStoreStats(*(sum(getattr(s, f) for s in stats) for f in PageStoreStats.__dataclass_fields__))

    def _metric(self, kind: str, ok: list, page_bytes: int, t0: float) -> None:
        if not self.metrics:
            return
        n = sum(ok)
        dt = time.perf_counter() - t0
        with self._lock:
            self._metric_lists[f"{kind}_pgs"].append(n)
            self._metric_lists[f"{kind}_bandwidth"].append(n * page_bytes / dt / 1e9 if dt > 0 else 0.0)

    def get_stats(self):
        """SGLang's StorageMetrics since the last call (None without --enable-storage-metrics)."""
        if not self.metrics:
            return None
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except Exception:          # noqa: BLE001 -- SGLang without its metrics module
            return None
        m = StorageMetrics()
        with self._lock:
            for k, v in self._metric_lists.items():
                getattr(m, k).extend(v)
                v.clear()
        return m

    def close(self) -> None:
        for st in [self._store, *self._plain.values()]:
            if st is not None:
                st.close()
