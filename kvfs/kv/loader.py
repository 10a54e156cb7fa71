"""The loader: block files -> page-aligned host staging -> destination tensor (CPU or GPU).

Per block, a reader thread reads the whole file in one go (fast path beside FUSE when the
daemon offers one, else through the mount) into one of ``staging`` page-aligned buffers and
verifies it (whole-file xxh3 on the fast path, per-layer xxh3 from the header otherwise);
the calling thread copies the payload into its slice of the destination (on a CUDA side
stream when the destination is on a GPU, overlapped with the next reads). Reads release the
GIL, so reading, hashing and copying overlap on separate cores.

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
from kvfs.kv.block import BlockInfo, check_header, verify_layers
from kvfs.kv.blockio import AlignedBuffer, OpenBlock, align_up, read_block_file
from kvfs.kv.format import HEADER_READ, BlockFormatError
from kvfs.kv.layout import KVLayout

log = logging.getLogger(__name__)


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


class _Staging:
    def __init__(self, size: int, pin: bool):
        self.buf = AlignedBuffer(size)
        self.tensor = torch.frombuffer(self.buf._map, dtype=torch.uint8)
        self.reg = gpu.PinnedRegistration(self.buf._map, self.buf.size) if pin else None

    @property
    def pinned(self) -> bool:
        return self.reg is not None and self.reg.pinned

    def close(self) -> None:
        if self.reg is not None:
            self.reg.close()
        del self.tensor
        self.buf.close()


class Loader:
    """Reads blocks of one layout into tensors. Not for concurrent use by several threads."""

    def __init__(self, layout: KVLayout, *, fast_path: bool = True, verify: bool = True,
                 readers: int = 4, staging: int = 8):
        if readers < 1 or staging < 2:
            raise ValueError("need readers >= 1 and staging >= 2")
        self.layout = layout
        self.fast_path = fast_path
        self.verify = verify
        self.readers = readers
        self.n_staging = staging
        self._block_buf_size = align_up(layout.block_bytes) + 2 * HEADER_READ
        self._pool = ThreadPoolExecutor(max_workers=readers, thread_name_prefix="kvfs-read")
        self._bufs: list[_Staging] = []
        self._pinned = False
        self._layer_bufs: list[_Staging] = []
        self._lock = threading.Lock()

    # -- staging --------------------------------------------------------------------------
    def _staging(self, pin: bool) -> list[_Staging]:
        if pin and not self._pinned:
            self._free(self._bufs)
            self._bufs = []
        if not self._bufs:
            self._bufs = [_Staging(self._block_buf_size, pin) for _ in range(self.n_staging)]
            self._pinned = pin
        return self._bufs

    @staticmethod
    def _free(bufs) -> None:
        for b in bufs:
            b.close()

    # -- whole blocks ---------------------------------------------------------------------
    def _read_one(self, plan: BlockPlan, st: _Staging) -> tuple[BlockInfo, str]:
        try:
            n, source = read_block_file(plan.path, st.buf.mv, fast_path=self.fast_path)
        except FileNotFoundError:
            raise BlockNotFound(f"block {plan.hash} (tokens ..{plan.tokens}) is not cached: {plan.path}") from None
        info = check_header(st.buf.mv, path=plan.path, expect_hash=plan.hash, layout=self.layout,
                            expect_tokens=plan.tokens)
        end = info.data_offset + self.layout.block_bytes
        if n != end:
            raise BlockFormatError(f"{plan.path}: {n} bytes, expected {end}")
        if source == "mount" and self.verify:
            verify_layers(info, st.buf.mv[info.data_offset:end], self.layout, plan.path)
        return info, source

    def load_into(self, plans: list[BlockPlan], out: torch.Tensor) -> LoadStats:
        """Fill ``out`` (``[L, 2, len(plans)*B, H, D]``, any device) from the blocks."""
        lay = self.layout
        self._check_out(out, len(plans))
        t0 = time.perf_counter()
        sources: collections.Counter = collections.Counter()
        if not plans:
            return LoadStats(0, 0, 0.0, {})
        with self._lock:
            copier = gpu.DeviceCopier(out.device)
            bufs = self._staging(pin=copier.cuda)
            free = collections.deque(bufs)
            pending: collections.deque = collections.deque()
            copying: collections.deque = collections.deque()
            nxt = 0
            B = lay.block_tokens
            try:
                for i in range(len(plans)):
                    while nxt < len(plans) and (free or copying) and len(pending) < len(bufs):
                        if not free:
                            tok, st = copying.popleft()
                            copier.wait(tok)
                            free.append(st)
                        st = free.popleft()
                        pending.append((self._pool.submit(self._read_one, plans[nxt], st), st))
                        nxt += 1
                    fut, st = pending.popleft()
                    info, source = fut.result()
                    sources[source] += 1
                    src = st.tensor[info.data_offset:info.data_offset + lay.block_bytes]
                    src = src.view(lay.torch_dtype).view(lay.block_shape())
                    tok = copier.copy(out[:, :, i * B:(i + 1) * B], src, pinned=st.pinned)
                    copying.append((tok, st))
                copier.finish()
            finally:
                for fut, st in pending:   # an error: let in-flight reads finish before reuse
                    try:
                        fut.result()
                    except BaseException:
                        pass
                for tok, st in copying:
                    copier.wait(tok)
        dt = time.perf_counter() - t0
        return LoadStats(len(plans), len(plans) * lay.block_bytes, dt, dict(sources))

    def _check_out(self, out: torch.Tensor, n_blocks: int) -> None:
        lay = self.layout
        want = lay.block_shape(n_blocks * lay.block_tokens)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
        if tuple(out.shape) != want:
            raise ValueError(f"out has shape {tuple(out.shape)}, expected {want}")
        if out.dtype != lay.torch_dtype:
            raise ValueError(f"out has dtype {out.dtype}, layout needs {lay.torch_dtype}")

    # -- layer by layer -------------------------------------------------------------------
    def iter_layers(self, plans: list[BlockPlan], out: torch.Tensor):
        """Fill ``out`` layer by layer; yields each layer index once ``out[layer]`` is ready.

        On CUDA the caller's current stream is made to wait for the layer's copy before the
        yield, so kernels it launches on that stream see the data.
        """
        lay = self.layout
        self._check_out(out, len(plans))
        if not out.is_contiguous():
            raise ValueError("iter_layers needs a contiguous out tensor")
        if not plans:
            return
        copier = gpu.DeviceCopier(out.device)
        n, lb = len(plans), lay.layer_bytes
        with self._lock:
            opened = list(self._pool.map(self._open_checked, plans))
            try:
                bufs = [_Staging(n * lb, copier.cuda) for _ in range(2)]
                try:
                    yield from self._layers_gen(opened, bufs, out, copier)
                finally:
                    for b in bufs:
                        b.close()
            finally:
                for blk, _ in opened:
                    blk.close()

    def _open_checked(self, plan: BlockPlan):
        try:
            blk = OpenBlock(plan.path, fast_path=self.fast_path)
        except FileNotFoundError:
            raise BlockNotFound(f"block {plan.hash} (tokens ..{plan.tokens}) is not cached: {plan.path}") from None
        try:
            head = AlignedBuffer(HEADER_READ)
            try:
                blk.pread_into(head.mv, 0, HEADER_READ)
                info = check_header(head.mv, path=plan.path, expect_hash=plan.hash, layout=self.layout,
                                    expect_tokens=plan.tokens)
            finally:
                head.close()
            if blk.size != info.data_offset + self.layout.block_bytes:
                raise BlockFormatError(f"{plan.path}: {blk.size} bytes, expected {info.data_offset + self.layout.block_bytes}")
        except BaseException:
            blk.close()
            raise
        return blk, info

    def _read_layer(self, opened, layer: int, st: _Staging) -> None:
        lb = self.layout.layer_bytes
        for i, (blk, info) in enumerate(opened):
            dst = st.buf.mv[i * lb:(i + 1) * lb]
            blk.pread_into(dst, info.data_offset + layer * lb, lb)
            verify_layers(info, dst, self.layout, blk.path, layers=range(layer, layer + 1))

    def _layers_gen(self, opened, bufs, out, copier):
        lay = self.layout
        n, L = len(opened), lay.num_layers
        shape = (n, 2, lay.block_tokens, lay.num_kv_heads, lay.head_dim)
        toks = [None, None]
        futs = {0: self._pool.submit(self._read_layer, opened, 0, bufs[0])}
        try:
            for layer in range(L):
                st = bufs[layer % 2]
                futs.pop(layer).result()
                if layer + 1 < L:
                    nb = (layer + 1) % 2
                    copier.wait(toks[nb])
                    futs[layer + 1] = self._pool.submit(self._read_layer, opened, layer + 1, bufs[nb])
                src = st.tensor[:n * lay.layer_bytes].view(lay.torch_dtype).view(shape)
                # [n, 2, B, H, D] -> out[layer]: [2, n*B, H, D]
                dst = out[layer].unflatten(1, (n, lay.block_tokens))
                toks[layer % 2] = copier.copy(dst, src.transpose(0, 1), pinned=st.pinned)
                copier.publish(toks[layer % 2])
                yield layer
        finally:
            for f in futs.values():
                try:
                    f.result()
                except BaseException:
                    pass
            for t in toks:
                copier.wait(t)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._free(self._bufs)
        self._bufs = []
