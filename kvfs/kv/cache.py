"""``kvfs.KVCache``: save, look up and load the KV cache of token prefixes on a kvfs mount.

::

    layout = kvfs.KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    cache = kvfs.KVCache("/mnt/kvfs", model="meta-llama/Llama-3.1-8B", layout=layout)
    n = cache.lookup(token_ids)           # tokens in the longest cached prefix (whole blocks)
    cache.save(token_ids, kv)             # kv: [num_layers, 2, tokens, num_kv_heads, head_dim]
    kv = cache.load(token_ids[:n], device="cuda:0")

    with cache.lookup(token_ids, hold=True) as held:     # found blocks held until the load
        kv = cache.load(token_ids[:held.tokens], hold=held)

Works on a kvfs mount (one-call lookups, fast-path loads) and on any plain directory.
"""
from __future__ import annotations

import collections
import dataclasses
import errno
import logging
import os
import threading

import torch

import xxhash

from kvfs.kv.hashing import MMInput, PrefixHasher, as_token_list, token_array
from kvfs.kv.layout import KVLayout, block_path, block_relpath, open_namespace
from kvfs.kv.blockio import LeaseClient
from kvfs.kv.loader import BlockPlan, Loader, LoadStats, check_verify_shm
from kvfs.kv.lookup import PrefixLookup
from kvfs.kv.writer import EXIT_TIMEOUT, BlockWriter, SaveJob, WriterStats

log = logging.getLogger(__name__)

_CHAIN_MEMO = 64       # prompts whose block hashes a KVCache remembers


class PrefixHold:
    """The cached prefix a ``KVCache.lookup(..., hold=True)`` found, held for the load.

    On a kvfs mount the blocks are leased (``.kvfs/lease``, one descriptor per hold): the
    daemon neither demotes, evicts nor frees them until the hold is released — by the load
    that uses it, ``release()``, leaving a ``with`` block, or the lease's ttl (the daemon's
    default 30 s, at most 600 s). On a plain directory nothing can be held: ``tokens`` is
    the plain lookup's answer. ``tokens``: tokens in the held prefix (whole blocks);
    ``tiers``: the tier of each held block (a mount only)."""

    def __init__(self, cache: "KVCache", rels: list[str], tokens: int, client: LeaseClient | None = None,
                 backings: list | None = None):
        self._cache = cache
        self.rels = rels                   # the held blocks' names (relative to the namespace)
        self.tokens = tokens
        self.backings = backings           # the lease's entries (None: nothing leased)
        self.tiers = [b.tier if b is not None else None for b in backings] if backings is not None else []
        self._client = client
        self._lock = threading.Lock()

    @property
    def blocks(self) -> int:
        return len(self.rels)

    @property
    def held(self) -> bool:
        """True while the daemon holds the blocks for this handle."""
        return self._client is not None

    def release(self) -> None:
        """Let the daemon move and evict the blocks again (idempotent)."""
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            self._cache._return_hold_client(client)

    def __enter__(self) -> "PrefixHold":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self):
        try:
            self.release()
        except Exception:  # noqa: BLE001 - the interpreter may be shutting down
            pass

    def __repr__(self) -> str:
        return f"PrefixHold(tokens={self.tokens}, blocks={self.blocks}, held={self.held})"


@dataclasses.dataclass(frozen=True)
class SaveResult:
    """What ``save`` did: blocks already cached, blocks queued for writing, blocks dropped."""

    blocks: int
    present: int
    queued: int
    dropped: int
    job: SaveJob | None = dataclasses.field(default=None, repr=False, compare=False)

    def wait(self, timeout: float | None = None) -> None:
        """Wait for this save's blocks to be written; raises the job's error, if any."""
        if self.job is None:
            return
        if not self.job.done.wait(timeout):
            raise TimeoutError(f"save still pending after {timeout}s")
        if self.job.error is not None:
            raise self.job.error


def _check_still_on(lookup: PrefixLookup, ns_dir: str, dev: int) -> None:
    """Raise ENOTCONN (closing ``lookup``) unless the lookup file and ``ns_dir`` are still on
    the kvfs mount (st_dev ``dev``) the namespace was made on: it may have died since."""
    try:
        on = lookup.one_call and os.fstat(lookup.fileno()).st_dev == dev == os.stat(ns_dir).st_dev
    except OSError:
        on = False
    if not on:
        lookup.close()
        raise OSError(errno.ENOTCONN, f"{ns_dir} left its kvfs mount while the cache opened")


class KVCache:
    """A prefix-hashed KV block cache in one namespace directory under ``root``.

    ``cache_salt`` isolates tenants (no block is shared across salts); ``lora_name`` keys
    blocks to an adapter; ``hash_algo`` is ``"sha256_cbor"`` (default) or ``"xxhash_cbor"``.
    ``save_timeout`` bounds how long ``save`` may block when the writer is backed up (the save
    is dropped after that; ``None`` waits). Saves still queued when the interpreter exits
    normally are written first, for at most ``exit_timeout`` seconds (``None``: no bound); a
    warning gives the count of blocks left unwritten. ``fast_path`` uses the daemon's backing files;
    ``verify`` checks layer checksums of blocks read through the mount. Fast-path reads always
    check the object's xxh3; ``verify_shm="once"`` (default) hashes a RAM-tier object in shared
    memory the first time and trusts it while its tmpfs file is unchanged, ``"always"`` hashes
    it on every load.

    ``revision`` and ``weights`` name the exact weights: the caller's revision string (a commit,
    a checkpoint tag) and ``weights``, the model itself (its bytes are fingerprinted here, see
    ``kvfs.kv.identity``) or a fingerprint string from ``weights_fingerprint``. Both go into the
    namespace, so KV saved by other weights is a miss. Without them the namespace is the one
    made by callers that passed none.
    """

    def __init__(self, root: str | os.PathLike, model: str, layout: KVLayout, cache_salt: str | None = None, *,
                 revision: str | None = None, weights=None, lora_name: str | None = None, hash_algo: str = "sha256_cbor", save_timeout: float | None = 1.0,
                 max_pending_saves: int = 64, store_token_ids: bool = True, fast_path: bool = True,
                 verify: bool = True, verify_shm: str = "once", readers: int = 4, staging: int = 8,
                 exit_timeout: float | None = EXIT_TIMEOUT):
        if not isinstance(layout, KVLayout):
            raise TypeError(f"layout must be a kvfs.KVLayout, got {type(layout).__name__}")
        check_verify_shm(verify_shm)                      # before anything is opened or started
        self.root = os.fspath(root)
        self.model = model
        self.layout = layout
        if weights is not None and not isinstance(weights, str):
            from kvfs.kv.identity import weights_fingerprint
            weights = weights_fingerprint(weights)
        self.revision = revision
        self.weights = weights
        self.hasher = PrefixHasher(layout.block_tokens, hash_algo, cache_salt=cache_salt, lora_name=lora_name)
        self.ns_dir, dev = open_namespace(self.root, model, layout, self.hasher.algo,
                                          revision=revision, weights=weights)
        self.namespace = os.path.basename(self.ns_dir)
        self.save_timeout = save_timeout
        self._lookup = PrefixLookup(self.ns_dir)
        if dev is not None:
            _check_still_on(self._lookup, self.ns_dir, dev)
        self._writer = BlockWriter(self.ns_dir, self.namespace, layout, self.hasher.algo,
                                   max_pending=max_pending_saves, store_token_ids=store_token_ids,
                                   exit_timeout=exit_timeout, mount_root=self._lookup.mount_root)
        leases = LeaseClient.open(self._lookup.mount_root, self.ns_dir) if fast_path else None
        self._loader = Loader(layout, fast_path=fast_path, verify=verify, verify_shm=verify_shm, readers=readers,
                              staging=staging, leases=leases)
        self._load_lock = threading.Lock()
        self.last_load: LoadStats | None = None
        self._closed = False
        self._chains: collections.OrderedDict = collections.OrderedDict()
        self._chain_lock = threading.Lock()
        self._fast_path = fast_path
        self._hold_clients: list[LeaseClient] = []     # idle lease descriptors for holds
        self._hold_lock = threading.Lock()

    # -- naming ---------------------------------------------------------------------------
    def _chain(self, token_ids, mm_inputs) -> list:
        """``[hex hashes, relative names, load plans]`` of a prompt (the last two built when first
        needed), memoised per prompt: a prompt is typically looked up, saved and loaded, and
        hashing it (even from the per-block memo) costs more than the daemon's answer. Keyed by
        xxh3-128 of the validated token ids."""
        arr = token_array(token_ids)
        key = (xxhash.xxh3_128_digest(arr), tuple(mm_inputs))
        with self._chain_lock:
            entry = self._chains.get(key)
            if entry is not None:
                self._chains.move_to_end(key)
                return entry
        entry = [self.hasher.hex_hashes(arr, mm_inputs=mm_inputs), None, None]
        with self._chain_lock:
            self._chains[key] = entry
            while len(self._chains) > _CHAIN_MEMO:
                self._chains.popitem(last=False)
        return entry

    def _chain_rels(self, token_ids, mm_inputs) -> list[str]:
        entry = self._chain(token_ids, mm_inputs)
        if entry[1] is None:
            entry[1] = [block_relpath(h) for h in entry[0]]
        return entry[1]

    def block_hashes(self, token_ids, *, mm_inputs: tuple[MMInput, ...] = ()) -> list[str]:
        """Hex hashes of every whole block of ``token_ids`` (chain order)."""
        return list(self._chain(token_ids, mm_inputs)[0])

    def block_paths(self, token_ids, *, mm_inputs: tuple[MMInput, ...] = ()) -> list[str]:
        return [block_path(self.ns_dir, h) for h in self.block_hashes(token_ids, mm_inputs=mm_inputs)]

    @property
    def one_call_lookup(self) -> bool:
        """True when ``lookup`` is answered by the kvfs daemon in one call."""
        return self._lookup.one_call

    # -- lookup ---------------------------------------------------------------------------
    def lookup(self, token_ids, *, mm_inputs: tuple[MMInput, ...] = (), hold: bool = False,
               hold_ttl: float | None = None):
        """Tokens in the longest cached prefix of ``token_ids`` (a multiple of block_tokens).

        ``hold=True`` returns a :class:`PrefixHold` instead (its ``tokens`` is that count):
        on a kvfs mount the found blocks are leased, so eviction and demotion cannot take
        them before the load. Pass it to ``load``/``load_into``/``load_layers`` (``hold=``),
        which release it, or release it yourself. ``hold_ttl`` bounds the hold in seconds
        (the daemon's default 30 s, at most 600 s)."""
        self._check_open()
        rels = self._chain_rels(token_ids, mm_inputs)
        if not hold:
            return self._lookup.prefix_rel(rels) * self.layout.block_tokens
        return self._hold(rels, hold_ttl)

    def _hold(self, rels: list[str], ttl: float | None) -> PrefixHold:
        B = self.layout.block_tokens
        client = self._hold_client() if rels else None
        if client is None:                     # a plain directory: nothing to hold
            k = self._lookup.prefix_rel(rels)
            return PrefixHold(self, rels[:k], k * B)
        client.ttl = ttl
        try:
            backings = client.acquire(rels)
        except OSError as e:               # like a failed load lease: carry on without one
            log.warning("holding a prefix failed (%s); looked up without a hold", e)
            client.close()
            k = self._lookup.prefix_rel(rels)
            return PrefixHold(self, rels[:k], k * B)
        k = len(backings)
        return PrefixHold(self, rels[:k], k * B, client, backings)

    def _hold_client(self) -> LeaseClient | None:
        if not self._fast_path or self._lookup.mount_root is None:
            return None
        with self._hold_lock:
            if self._hold_clients:
                return self._hold_clients.pop()
        return LeaseClient.open(self._lookup.mount_root, self.ns_dir)

    def _return_hold_client(self, client: LeaseClient) -> None:
        """A hold ended: release its lease and keep the descriptor for the next hold."""
        try:
            client.release()
        except OSError as e:
            log.warning("releasing a held prefix failed (%s); its lease expires on its own", e)
            client.close()
            return
        with self._hold_lock:
            if not self._closed and len(self._hold_clients) < 8:
                self._hold_clients.append(client)
                return
        client.close()

    def lookup_tiers(self, token_ids, *, mm_inputs: tuple[MMInput, ...] = ()) -> tuple[int, list[str]]:
        """``(tokens, tiers)``: like ``lookup``, plus the tier of each cached block (on a mount)."""
        self._check_open()
        k, tiers = self._lookup.tiers_rel(self._chain_rels(token_ids, mm_inputs))
        return k * self.layout.block_tokens, tiers

    # -- save -----------------------------------------------------------------------------
    def save(self, token_ids, kv: torch.Tensor, *, mm_inputs: tuple[MMInput, ...] = (),
             wait: bool = False) -> SaveResult:
        """Save the whole blocks of ``kv`` (``[L, 2, >= tokens, H, D]``) under ``token_ids``.

        Blocks already cached are skipped. The rest are snapshotted (copied to host memory)
        and written in the background; ``wait=True`` (or ``flush()``) waits for them.
        """
        self._check_open()
        tokens = as_token_list(token_ids)
        lay, B = self.layout, self.layout.block_tokens
        self._check_kv(kv, len(tokens))
        hashes = self.block_hashes(tokens, mm_inputs=mm_inputs)
        n = len(hashes)
        present = self._lookup.prefix_rel(self._chain_rels(tokens, mm_inputs))
        if present == n:
            return SaveResult(n, n, 0, 0)
        m = n - present
        # snapshot as [m, L, 2, B, H, D]: each block one contiguous byte range
        part = kv[:, :, present * B:n * B].detach().unflatten(2, (m, B)).permute(2, 0, 1, 3, 4, 5)
        ready = None
        if part.is_cuda:
            host = torch.empty(part.shape, dtype=part.dtype, pin_memory=True)
            host.copy_(part, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
            ready = ev.synchronize
        else:
            host = part.clone(memory_format=torch.contiguous_format)

        def payload(j: int):
            return host[j].view(torch.uint8).numpy()

        job = SaveJob(hashes=hashes[present:], parents=([""] + hashes)[present:n], first=present,
                      token_ids=[tokens[i * B:(i + 1) * B] for i in range(present, n)],
                      payload=payload, ready=ready)
        queued = self._writer.submit(job, self.save_timeout)
        if queued and wait:
            SaveResult(n, present, n - present, 0, job).wait()
        return SaveResult(n, present, n - present if queued else 0, 0 if queued else n - present, job)

    def _check_kv(self, kv, n_tokens: int) -> None:
        lay = self.layout
        if not isinstance(kv, torch.Tensor):
            raise TypeError(f"kv must be a torch.Tensor, got {type(kv).__name__}")
        want = (lay.num_layers, 2, lay.num_kv_heads, lay.head_dim)
        if kv.dim() != 5 or (kv.shape[0], kv.shape[1], kv.shape[3], kv.shape[4]) != want:
            raise ValueError(f"kv must be [num_layers={lay.num_layers}, 2, tokens, num_kv_heads={lay.num_kv_heads}, "
                             f"head_dim={lay.head_dim}], got {tuple(kv.shape)}")
        if kv.dtype != lay.torch_dtype:
            raise ValueError(f"kv has dtype {kv.dtype}, the layout stores {lay.torch_dtype}")
        whole = (n_tokens // lay.block_tokens) * lay.block_tokens
        if kv.shape[2] < whole:
            raise ValueError(f"kv covers {kv.shape[2]} tokens, token_ids has {whole} in whole blocks")

    def flush(self, timeout: float | None = None) -> None:
        """Wait for queued saves; raises SaveError for any that failed since the last flush."""
        self._writer.flush(timeout)

    def save_statistics(self) -> WriterStats:
        return self._writer.statistics()

    # -- load -----------------------------------------------------------------------------
    def _plans(self, token_ids, mm_inputs) -> list[BlockPlan]:
        arr = token_array(token_ids)                      # validated (any iterable of ints)
        entry = self._chain(arr, mm_inputs)
        n, B = len(arr), self.layout.block_tokens
        if n % B:
            raise ValueError(f"load needs whole blocks: {n} tokens is not a multiple of {B} "
                             "(use the count lookup() returns)")
        if entry[2] is None:
            entry[2] = [BlockPlan(block_path(self.ns_dir, h), h, (i + 1) * B) for i, h in enumerate(entry[0])]
        return entry[2]

    def _held(self, plans: list[BlockPlan], hold: PrefixHold | None):
        """The lease entries of ``hold`` for ``plans`` (None: no hold, or nothing leased)."""
        if hold is None:
            return None
        if not isinstance(hold, PrefixHold) or hold._cache is not self:
            raise ValueError("hold must be a PrefixHold from this KVCache's lookup(..., hold=True)")
        if not hold.held:
            if hold.backings is not None:
                raise ValueError("this PrefixHold was already released (a load releases it)")
            return None
        n = min(len(plans), hold.blocks)
        if [block_relpath(p.hash) for p in plans[:n]] != hold.rels[:n]:
            raise ValueError("the tokens to load are not the prefix this hold was looked up for")
        return hold.backings

    def _held_plans(self, token_ids, mm_inputs, hold: PrefixHold | None):
        """The load plans of ``token_ids``; ``hold`` is released if they cannot be made."""
        self._check_open()
        try:
            return self._plans(token_ids, mm_inputs)
        except BaseException:
            if hold is not None:
                hold.release()
            raise

    def load(self, token_ids, device="cpu", *, mm_inputs: tuple[MMInput, ...] = (),
             hold: PrefixHold | None = None) -> torch.Tensor:
        """The KV of ``token_ids`` (whole blocks, all cached) as ``[L, 2, tokens, H, D]``.

        ``hold``: the ``PrefixHold`` of a ``lookup(..., hold=True)`` of these tokens; its
        blocks are read from where it holds them, and it is released when the load ends.
        Raises BlockNotFound if a block is missing, BlockFormatError/ChecksumMismatch if one
        is damaged.
        """
        plans = self._held_plans(token_ids, mm_inputs, hold)
        from kvfs import gpu
        shape = self.layout.block_shape(len(plans) * self.layout.block_tokens)
        dev = gpu.device_of(device)
        if dev.type == "cpu":
            out = gpu.host_empty(shape, self.layout.torch_dtype)     # page aligned: faster reads
        else:
            out = torch.empty(shape, dtype=self.layout.torch_dtype, device=dev)
        self._load(plans, out, hold)
        return out

    def load_into(self, token_ids, out: torch.Tensor, *, mm_inputs: tuple[MMInput, ...] = (),
                  hold: PrefixHold | None = None) -> LoadStats:
        """Fill the preallocated ``out`` (``[L, 2, tokens, H, D]``) with the KV of ``token_ids``
        (``hold``: as for ``load``)."""
        plans = self._held_plans(token_ids, mm_inputs, hold)
        return self._load(plans, out, hold)

    def load_layers(self, token_ids, out: torch.Tensor, *, mm_inputs: tuple[MMInput, ...] = (),
                    hold: PrefixHold | None = None):
        """Fill ``out`` layer by layer, yielding each layer index as soon as it is in place
        (``hold``: as for ``load``, released when the generator ends)."""
        self._check_open()
        try:
            plans = self._plans(token_ids, mm_inputs)
            with self._load_lock:
                yield from self._loader.iter_layers(plans, out, held=self._held(plans, hold))
        finally:
            if hold is not None:
                hold.release()

    def _load(self, plans, out, hold: PrefixHold | None = None) -> LoadStats:
        try:
            held = self._held(plans, hold)
            with self._load_lock:
                stats = self._loader.load_into(plans, out, held=held)
        finally:
            if hold is not None:
                hold.release()
        self.last_load = stats
        return stats

    # -- lifecycle ------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this KVCache is closed")

    def close(self, timeout: float | None = None) -> None:
        """Flush pending saves and release files, threads and buffers."""
        if self._closed:
            return
        self._closed = True
        try:
            self._writer.close(timeout)
        finally:
            with self._hold_lock:
                idle, self._hold_clients = self._hold_clients, []
            for client in idle:
                client.close()
            self._loader.close()
            self._lookup.close()

    def __enter__(self) -> "KVCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"KVCache({self.ns_dir!r}, model={self.model!r}, layout={self.layout})"
