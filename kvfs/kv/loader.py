"""The loader: block files -> page-aligned host staging -> destination tensor (CPU or GPU).

On a kvfs mount the loader first leases every block of the request in one call to the
daemon (``.kvfs/lease``: each block's backing file and offset, held in place until released)
and reads the backing files directly, beside FUSE; blocks without a fast path (the remote
tier, small objects) and blocks past the leased prefix are read through the mount.

A CPU destination that is contiguous is filled in place: one ``preadv`` per block scatters
the header into a small buffer and the payload straight into the block's ``2 * num_layers``
slices of ``out`` (no staging copy), then the block is verified (whole-object xxh3 from the
lease, or the per-layer xxh3 of the header when read through the mount). Other destinations
(CUDA, strided) go through ``staging`` page-aligned (pinned) buffers: a reader thread reads
and verifies a block, the calling thread copies it into the destination (on a CUDA side
stream, overlapped with the next reads). Reads and hashing release the GIL, so they overlap
on separate cores.

Verification: a block from the NVMe tier (O_DIRECT) or through the mount is hashed on every
load; a block in shared memory (the RAM tier's immutable tmpfs file) is hashed the first time
and then trusted while its file identity is unchanged (``verify_shm="once"``, see
``blockio.VerifiedObjects``), or every time (``"always"``).

``iter_layers`` loads layer by layer instead (all blocks' slice of layer 0, then layer 1,
...), yielding each layer as soon as it is in place so compute can start early.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from kvfs import gpu
import xxhash

from kvfs.kv.block import BlockInfo, ChecksumMismatch, check_header, verify_layers
from kvfs.kv.blockio import (PAGE, AlignedBuffer, Backing, LeaseClient, OpenBlock, VerifiedObjects, align_up,
                             mismatch, preadv_full, read_backing, read_backing_into, read_block_file)
from kvfs.blockformat import HEADER_READ, BlockFormatError
from kvfs.kv.layers import LayerLoads
from kvfs.kv.layout import KVLayout

log = logging.getLogger(__name__)


_CHECKED_MAX = 1 << 16
PIECE = 512 << 10          # in-place reads land and are hashed in pieces of about this size
CHUNK_BYTES = 16 << 20     # a device (or strided) destination is filled through host chunks of this
CHUNKS = 3                 # size, this many: two being read while the third is copied out


def check_verify_shm(value) -> None:
    if value not in ("once", "always"):
        raise ValueError(f"verify_shm must be 'once' or 'always', got {value!r}")


class BlockNotFound(KeyError):
    """A block of the requested prefix is not in the cache (never saved, or evicted)."""

    def __str__(self):
        return str(self.args[0]) if self.args else "block not found"


@dataclasses.dataclass(frozen=True)
class BlockPlan:
    path: str
    hash: str
    tokens: int     # tokens up to and including this block


@dataclasses.dataclass(frozen=True)
class LoadStats:
    blocks: int
    bytes: int
    seconds: float
    sources: dict   # "mount" / "ram" / "nvme" / ... -> blocks

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class _HostBuffer:
    def __init__(self, size: int, pin: bool):
        self.buf = AlignedBuffer(size)
        self.tensor = torch.frombuffer(self.buf.mapping, dtype=torch.uint8)
        self.reg = gpu.PinnedRegistration(self.buf.mapping, self.buf.size) if pin else None

    @property
    def pinned(self) -> bool:
        return self.reg is not None and self.reg.pinned

    def close(self) -> None:
        if self.reg is not None:
            self.reg.close()
        del self.tensor
        self.buf.close()


class Loader(LayerLoads):
    """Reads blocks of one layout into tensors. Not for concurrent use by several threads."""

    def __init__(self, layout: KVLayout, *, fast_path: bool = True, verify: bool = True,
                 verify_shm: str = "once", readers: int = 4, staging: int = 8, leases: LeaseClient | None = None,
                 shm_readers: int | None = None):
        if readers < 1 or staging < 2:
            raise ValueError("need readers >= 1 and staging >= 2")
        check_verify_shm(verify_shm)
        # shared-memory (RAM tier) objects: hashed the first time, then trusted while their
        # tmpfs file is unchanged ("once"), or hashed on every read ("always")
        self.verified = VerifiedObjects() if verify_shm == "once" else None
        self.layout = layout
        self.fast_path = fast_path
        self.leases = leases if fast_path else None
        self._local = threading.local()
        self._checked: dict = {}        # (object checksum, hash, tokens) of headers checked
        # blocks in shared memory: a kernel copy and a hash each, memory bound; one reader per CPU
        self.shm_readers = shm_readers or max(1, min(readers, os.cpu_count() or 1))
        self._bases: dict[int, list[int]] = {}
        self._cut_list = None
        self.verify = verify
        self.readers = readers
        self.n_staging = staging
        self._block_buf_size = align_up(layout.block_bytes) + 2 * HEADER_READ
        self._pool = ThreadPoolExecutor(max_workers=readers, thread_name_prefix="kvfs-read")
        self._bufs: list[_HostBuffer] = []
        self._pinned = False
        self._layer_bufs: list[_HostBuffer] = []
        self._chunks: list[_HostBuffer] = []
        self._chunks_pinned = False
        self._lock = threading.Lock()

    # -- staging --------------------------------------------------------------------------
    def _staging(self, pin: bool) -> list[_HostBuffer]:
        if pin and not self._pinned:
            self._free(self._bufs)
            self._bufs = []
        if not self._bufs:
            self._bufs = [_HostBuffer(self._block_buf_size, pin) for _ in range(self.n_staging)]
            self._pinned = pin
        return self._bufs

    @staticmethod
    def _free(bufs) -> None:
        for b in bufs:
            b.close()

    # -- leases ---------------------------------------------------------------------------
    def _lease(self, plans: list[BlockPlan]) -> list[Backing | None]:
        """Backing locations of the leading blocks, leased in one call (empty: no lease)."""
        if self.leases is None:
            return []
        rels = [self.leases.rel(p.path) for p in plans]
        if None in rels:
            return []
        try:
            return self.leases.acquire(rels)
        except OSError as e:
            log.warning("lease request failed (%s); reading through the mount", e)
            return []

    def _lease_or_held(self, plans: list[BlockPlan], held) -> tuple[list[Backing | None], bool]:
        """``(backings of the leading blocks, whether this load owns the lease)``."""
        if held is not None:
            return list(held[:len(plans)]), False
        return self._lease(plans), True

    def _release(self, leased, *, wait: bool = True) -> None:
        """End the lease. ``wait=False``: on a reader thread, off the caller's critical path
        (a later lease on the descriptor ends it anyway; only this generation is released)."""
        if not leased:
            return
        if not wait:
            self._pool.submit(self._release_quietly, self.leases.generation)
            return
        self._release_quietly(None)

    def _release_quietly(self, generation) -> None:
        try:
            self.leases.release(generation)
        except OSError as e:
            log.warning("lease release failed (%s); it expires on its own", e)

    def _verified(self, b: Backing) -> VerifiedObjects | None:
        """The verified-object set that applies to ``b``: shared memory only (never a file
        read from a device)."""
        return self.verified if b.tier == "ram" and not b.direct else None

    # -- whole blocks ---------------------------------------------------------------------
    def _not_found(self, plan: BlockPlan) -> BlockNotFound:
        return BlockNotFound(f"block {plan.hash} (tokens ..{plan.tokens}) is not cached: {plan.path}")

    def _read_one(self, plan: BlockPlan, st: _HostBuffer, backing: Backing | None, xattr: bool) -> tuple[BlockInfo, str]:
        """Read a whole block into a staging buffer and check it."""
        n = source = None
        if backing is not None:
            try:
                n, source = read_backing(backing, st.buf.mv, verified=self._verified(backing)), backing.tier
            except OSError as e:
                log.warning("%s: fast path failed (%s); reading through the mount", plan.path, e)
        if n is None:
            try:
                n, source = read_block_file(plan.path, st.buf.mv, fast_path=xattr)
            except FileNotFoundError:
                raise self._not_found(plan) from None
        if backing is not None and source == backing.tier:      # bytes verified: remember the header
            info = self._header(plan, st.buf.mv, backing.checksum)
            self._remember((backing.checksum, plan.hash, plan.tokens), info)
        else:
            info = self._header(plan, st.buf.mv)
        end = info.data_offset + self.layout.block_bytes
        if n != end:
            raise BlockFormatError(f"{plan.path}: {n} bytes, expected {end}")
        if source == "mount" and self.verify:
            verify_layers(info, st.buf.mv[info.data_offset:end], self.layout, plan.path)
        return info, source

    def _header(self, plan: BlockPlan, head, checksum: str | None = None) -> BlockInfo:
        """The block's header, checked; one already checked under the same object checksum
        (the bytes it covers verified) is that header (see ``_remember``)."""
        info = self._checked.get((checksum, plan.hash, plan.tokens)) if checksum else None
        if info is None:
            info = check_header(head, path=plan.path, expect_hash=plan.hash, layout=self.layout,
                                expect_tokens=plan.tokens)
        return info

    def _remember(self, key, info: BlockInfo) -> None:
        """Remember a checked header under the (verified) object checksum it came with."""
        if key in self._checked:
            return
        self._checked[key] = info
        if len(self._checked) > _CHECKED_MAX:
            try:
                self._checked.pop(next(iter(self._checked)), None)
            except (RuntimeError, StopIteration):      # another reader changed it meanwhile
                pass

    def _read_copy(self, plan: BlockPlan, st: _HostBuffer, backing: Backing | None, xattr: bool,
                   out: torch.Tensor, i: int, copier) -> str:
        """Read a block into staging, check it and copy it into block ``i`` of a CPU ``out``."""
        lay = self.layout
        B = lay.block_tokens
        dst = out[:, :, i * B:(i + 1) * B]
        if backing is not None and backing.direct:
            try:
                return self._copy_hashing(plan, st, backing, dst, copier)
            except OSError as e:
                log.warning("%s: fast path failed (%s); reading through the mount", plan.path, e)
                backing = None
        info, source = self._read_one(plan, st, backing, xattr)
        src = st.tensor[info.data_offset:info.data_offset + lay.block_bytes]
        copier.copy(dst, src.view(lay.torch_dtype).view(lay.block_shape()))
        return source

    def _copy_hashing(self, plan: BlockPlan, st: _HostBuffer, b: Backing, dst: torch.Tensor, copier) -> str:
        """An O_DIRECT block: read it whole into staging (it lands in memory, not in the CPU
        cache), then copy it out a ~512 KiB run of layers at a time and hash each run right
        after its copy, while it is cache-hot: one pass over memory instead of two. The
        object's bytes are hashed in order, so the checksum covers exactly what was copied;
        a mismatch is an error (``dst`` then holds unverified bytes and must not be used)."""
        lay = self.layout
        n = read_backing(b, st.buf.mv, check=False)
        mv = st.buf.mv
        info = self._header(plan, mv, b.checksum)
        start, end = info.data_offset, info.data_offset + lay.block_bytes
        if n != end:
            raise BlockFormatError(f"{plan.path}: {n} bytes, expected {end}")
        src = st.tensor[start:end].view(lay.torch_dtype).view(lay.block_shape())
        h = xxhash.xxh3_64(mv[:start])
        lb, per = lay.layer_bytes, max(1, PIECE // lay.layer_bytes)
        for a in range(0, lay.num_layers, per):
            z = min(a + per, lay.num_layers)
            copier.copy(dst[a:z], src[a:z])
            h.update(mv[start + a * lb:start + z * lb])
        got = h.hexdigest()
        if got != b.checksum:
            raise mismatch(b, got)
        self._remember((b.checksum, plan.hash, plan.tokens), info)
        return b.tier

    def _head(self, size: int) -> memoryview:
        buf = getattr(self._local, "head", None)
        if buf is None or buf.size < size:
            buf = self._local.head = AlignedBuffer(max(size, 2 * HEADER_READ))
        return buf.mv[:size]

    def _segments(self, out_mv: memoryview, T: int, i: int) -> list[memoryview]:
        """The byte ranges of block ``i`` in a contiguous ``[L, 2, T, H, D]`` destination."""
        lay = self.layout
        seg = lay.layer_bytes // 2               # one layer's K (or V) of one block
        bases = self._bases.get(T)
        if bases is None:
            if len(self._bases) >= 64:          # one entry per destination length seen
                self._bases.clear()
            stride = T * seg // lay.block_tokens
            bases = self._bases[T] = [j * stride for j in range(2 * lay.num_layers)]
        first = i * seg
        return [out_mv[b + first:b + first + seg] for b in bases]

    def _cuts(self) -> list[tuple[int, int, int]]:
        """The block's ``2 * num_layers`` segments cut into pieces of about PIECE bytes (read,
        then hashed while cached): ``(first, end, nbytes)``."""
        if self._cut_list is None:
            lay = self.layout
            seg = lay.layer_bytes // 2
            n = 2 * lay.num_layers
            per = max(1, PIECE // seg)
            self._cut_list = [(a, min(a + per, n), (min(a + per, n) - a) * seg) for a in range(0, n, per)]
        return self._cut_list

    def _read_in_place(self, plan: BlockPlan, backing: Backing | None, out_mv: memoryview, T: int, i: int) -> str:
        """Read block ``i`` straight into its slices of the (contiguous, CPU) destination."""
        lay = self.layout
        segs = self._segments(out_mv, T, i)
        if backing is not None:
            off = backing.size - lay.block_bytes
            if 8 <= off <= 2 * HEADER_READ and off % PAGE == 0:
                head = self._head(off)
                try:
                    read_backing_into(backing, head, segs, self._cuts(), verified=self._verified(backing))
                except OSError as e:
                    log.warning("%s: fast path failed (%s); reading through the mount", plan.path, e)
                else:
                    # the header bytes are covered by the object checksum just verified
                    info = self._header(plan, head, backing.checksum)
                    if info.data_offset != off:
                        raise BlockFormatError(f"{plan.path}: payload at {info.data_offset}, object size says {off}")
                    self._remember((backing.checksum, plan.hash, plan.tokens), info)
                    return backing.tier
        try:
            fd = os.open(plan.path, os.O_RDONLY)
        except FileNotFoundError:
            raise self._not_found(plan) from None
        try:
            size = os.fstat(fd).st_size
            off = size - lay.block_bytes
            if not 8 <= off <= 2 * HEADER_READ:      # say what is wrong with it
                head = self._head(HEADER_READ)
                n = preadv_full(fd, [head], 0)
                info = self._header(plan, head[:n])
                raise BlockFormatError(f"{plan.path}: {size} bytes, expected {info.data_offset + lay.block_bytes}")
            head = self._head(off)
            n = preadv_full(fd, [head, *segs], 0)
        finally:
            os.close(fd)
        if n != size:
            raise BlockFormatError(f"{plan.path}: short read ({n} of {size} bytes)")
        info = self._header(plan, head)
        if info.data_offset != off:
            raise BlockFormatError(f"{plan.path}: payload at {info.data_offset}, file size says {off}")
        if self.verify:
            for layer in range(lay.num_layers):
                h = xxhash.xxh3_64(segs[2 * layer])
                h.update(segs[2 * layer + 1])
                if h.hexdigest() != info.checksums[layer]:
                    raise ChecksumMismatch(f"{plan.path}: layer {layer} checksum {h.hexdigest()} "
                                           f"!= {info.checksums[layer]}")
        return "mount"

    def _read_group(self, plans, backing, out_mv, T: int, indices) -> collections.Counter:
        got: collections.Counter = collections.Counter()
        for i in indices:
            got[self._read_in_place(plans[i], backing(i), out_mv, T, i)] += 1
        return got

    @staticmethod
    def _bytes_of(out: torch.Tensor) -> memoryview:
        return memoryview(gpu.as_numpy(out).reshape(-1).view("uint8"))

    def load_into(self, plans: list[BlockPlan], out: torch.Tensor, *,
                  held: list[Backing | None] | None = None) -> LoadStats:
        """Fill ``out`` (``[L, 2, len(plans)*B, H, D]``, any device) from the blocks.

        ``held``: the backings of a lease the caller already holds on the leading blocks
        (``KVCache.lookup(..., hold=True)``): used instead of a new lease, and not released
        here (the holder releases it)."""
        lay = self.layout
        self._check_out(out, len(plans))
        t0 = time.perf_counter()
        sources: collections.Counter = collections.Counter()
        if not plans:
            return LoadStats(0, 0, 0.0, {})
        with self._lock:
            copier = gpu.DeviceCopier(out.device)
            in_place = not copier.cuda and out.device.type == "cpu" and out.is_contiguous()
            out_mv = self._bytes_of(out) if in_place else None
            T = out.shape[2]
            leased, own = self._lease_or_held(plans, held)
            # no lease file (a plain directory, an older daemon): try the per-file xattr
            xattr = self.fast_path and self.leases is None

            def backing(i: int) -> Backing | None:
                return leased[i] if i < len(leased) else None

            def direct(i: int) -> bool:
                # O_DIRECT backings go through staging: one contiguous read per block (scattered
                # O_DIRECT iovecs became one small disk request each: measured 0.56x)
                b = backing(i)
                return in_place and not xattr and (b is None or not b.direct)
            try:
                if all(map(direct, range(len(plans)))):
                    self._load_all_direct(plans, backing, out_mv, T, leased, sources)
                elif not xattr and not any(b is not None and b.direct for b in leased):
                    self._load_chunked(plans, backing, leased, out, copier, sources)
                else:
                    self._load_staged(plans, backing, direct, xattr, out, out_mv, T, copier, sources)
            finally:
                self._release(leased if own else None, wait=False)
        dt = time.perf_counter() - t0
        return LoadStats(len(plans), len(plans) * lay.block_bytes, dt, dict(sources))

    def _load_all_direct(self, plans, backing, out_mv, T, leased, sources) -> None:
        """Every block straight into ``out``'s bytes (CPU, contiguous, no O_DIRECT backing),
        dealt round-robin to a few groups, one task per group (fewer thread handoffs than one
        per block), the calling thread taking the first. Blocks in shared memory (memory bound)
        use one group per CPU; blocks read through the mount wait on the daemon: every reader."""
        futs = []
        shm = len(leased) == len(plans) and all(b is not None for b in leased)
        n_groups = min(self.shm_readers if shm else self.readers, len(plans))
        try:
            for k in range(1, n_groups):
                futs.append(self._pool.submit(self._read_group, plans, backing, out_mv, T,
                                              range(k, len(plans), n_groups)))
            sources.update(self._read_group(plans, backing, out_mv, T, range(0, len(plans), n_groups)))
            for f in futs:
                sources.update(f.result())
        finally:
            _drain(futs)

    def _chunk_buffers(self, size: int, pin: bool) -> list[_HostBuffer]:
        if self._chunks and (self._chunks[0].buf.size < size or self._chunks_pinned != pin):
            self._free(self._chunks)
            self._chunks = []
        if not self._chunks:
            self._chunks = [_HostBuffer(size, pin) for _ in range(CHUNKS)]
            self._chunks_pinned = pin
        return self._chunks

    def _load_chunked(self, plans, backing, leased, out, copier, sources) -> None:
        """A device or strided destination, no O_DIRECT backing: runs of consecutive blocks are
        read in place (as into a contiguous CPU ``out``, by every reader) into a contiguous
        host chunk shaped ``[L, 2, blocks*B, H, D]``, then cross as one copy per chunk while
        the next chunks are read. One copy launch per chunk, not per block: the calling
        thread's per-block Python work (slicing, a stream context, an event) held the GIL for
        ~40% of a 2 MiB-block load into an H200 and capped it below the readers' rate."""
        lay = self.layout
        B, n = lay.block_tokens, len(plans)
        per = max(1, min(n, CHUNK_BYTES // lay.block_bytes))
        bufs = self._chunk_buffers(per * lay.block_bytes, copier.cuda)
        shm = len(leased) == n and all(b is not None for b in leased)
        workers = min(self.shm_readers if shm else self.readers, per)
        free = collections.deque(bufs)
        reading: collections.deque = collections.deque()
        copying: collections.deque = collections.deque()
        starts = collections.deque(range(0, n, per))

        def start(a: int, hb: _HostBuffer) -> None:
            z = min(a + per, n)
            mv = hb.buf.mv[:(z - a) * lay.block_bytes]
            sub = plans[a:z]
            futs = [self._pool.submit(self._read_group, sub, lambda k: backing(a + k), mv, (z - a) * B,
                                      range(k, z - a, workers)) for k in range(min(workers, z - a))]
            reading.append((a, z, hb, futs))
        try:
            while starts or reading:
                while starts and len(reading) < len(bufs) - 1:
                    if not free:
                        tok, hb = copying.popleft()
                        copier.wait(tok)
                        free.append(hb)
                    start(starts.popleft(), free.popleft())
                a, z, hb, futs = reading.popleft()
                for f in futs:
                    sources.update(f.result())
                src = hb.tensor[:(z - a) * lay.block_bytes].view(lay.torch_dtype).view(lay.block_shape((z - a) * B))
                copying.append((copier.copy(out[:, :, a * B:z * B], src, pinned=hb.pinned), hb))
            copier.finish()
        finally:
            _drain([f for _, _, _, futs in reading for f in futs], copying, copier)

    def _load_staged(self, plans, backing, direct, xattr, out, out_mv, T, copier, sources) -> None:
        """Blocks through staging buffers (O_DIRECT backings, devices, strided ``out``)."""
        lay = self.layout
        bufs = self._staging(pin=copier.cuda)
        free = collections.deque(bufs)
        window = max(len(bufs), 2 * self.readers)
        pending: collections.deque = collections.deque()
        copying: collections.deque = collections.deque()
        nxt = 0
        B = lay.block_tokens
        try:
            for i in range(len(plans)):
                while nxt < len(plans) and len(pending) < window:
                    if direct(nxt):
                        fut = self._pool.submit(self._read_in_place, plans[nxt], backing(nxt), out_mv, T, nxt)
                        pending.append((fut, None))
                    else:
                        if not free:
                            if not copying:
                                break
                            tok, st = copying.popleft()
                            copier.wait(tok)
                            free.append(st)
                        st = free.popleft()
                        if copier.cuda:
                            fut = self._pool.submit(self._read_one, plans[nxt], st, backing(nxt), xattr)
                            pending.append((fut, st))
                        else:     # the reader copies too (numpy, without the GIL): copies in parallel
                            fut = self._pool.submit(self._read_copy, plans[nxt], st, backing(nxt), xattr,
                                                    out, nxt, copier)
                            pending.append((fut, (st,)))
                    nxt += 1
                fut, st = pending.popleft()
                if st is None:
                    sources[fut.result()] += 1
                    continue
                if isinstance(st, tuple):
                    sources[fut.result()] += 1
                    free.append(st[0])
                    continue
                info, source = fut.result()
                sources[source] += 1
                src = st.tensor[info.data_offset:info.data_offset + lay.block_bytes]
                src = src.view(lay.torch_dtype).view(lay.block_shape())
                tok = copier.copy(out[:, :, i * B:(i + 1) * B], src, pinned=st.pinned)
                copying.append((tok, st))
            copier.finish()
        finally:
            _drain([fut for fut, _ in pending], copying, copier)

    def _check_out(self, out: torch.Tensor, n_blocks: int) -> None:
        lay = self.layout
        want = lay.block_shape(n_blocks * lay.block_tokens)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
        if tuple(out.shape) != want:
            raise ValueError(f"out has shape {tuple(out.shape)}, expected {want}")
        if out.dtype != lay.torch_dtype:
            raise ValueError(f"out has dtype {out.dtype}, layout needs {lay.torch_dtype}")

    # -- layer by layer (the rest in kvfs.kv.layers) -------------------------------------
    def _open_checked(self, plan: BlockPlan, backing: Backing | None = None):
        try:
            blk = OpenBlock(plan.path, fast_path=self.fast_path and self.leases is None, backing=backing)
        except FileNotFoundError:
            raise BlockNotFound(f"block {plan.hash} (tokens ..{plan.tokens}) is not cached: {plan.path}") from None
        try:
            head = AlignedBuffer(HEADER_READ)
            try:
                blk.pread_into(head.mv, 0, HEADER_READ)
                info = self._header(plan, head.mv)
            finally:
                head.close()
            if blk.size != info.data_offset + self.layout.block_bytes:
                raise BlockFormatError(f"{plan.path}: {blk.size} bytes, expected {info.data_offset + self.layout.block_bytes}")
            # a shared-memory object a whole-block load already verified, unchanged since: its
            # layers need no per-layer hashes
            seen = self._verified(blk.backing) if blk.backing is not None else None
            st = blk.backing_stat() if seen is not None else None
            blk.trusted = st is not None and VerifiedObjects.key(blk.backing, st) in seen
        except BaseException:
            blk.close()
            raise
        return blk, info

    def _host_buffer(self, size: int, pin: bool) -> _HostBuffer:
        return _HostBuffer(size, pin)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self.leases is not None:
            self.leases.close()
        self._free(self._bufs)
        self._free(self._chunks)
        self._bufs, self._chunks = [], []


def _drain(futs, copying=(), copier=None) -> None:
    """After an error: let in-flight reads finish and wait for the copies under way, so no
    buffer is reused (or freed) while a reader or a copy still uses it."""
    for f in futs:
        try:
            f.result()
        except BaseException:       # noqa: BLE001 -- the first error is the one raised
            pass
    for tok, _ in copying:
        copier.wait(tok)
