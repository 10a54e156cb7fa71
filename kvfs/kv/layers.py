"""Layer-by-layer loads (``KVCache.load_layers``): the part of :class:`kvfs.kv.loader.Loader`
that fills ``out`` one layer at a time, so a runtime can start computing layer 0 while the
rest is still being read.

A layer of n blocks is n slices (one per block file), dealt to the loader's readers into one
of two staging buffers laid out ``[n, 2, B, H, D]``; the next layer is read while this one is
copied. On CUDA the staging buffer crosses as one contiguous pinned copy and is transposed into
``out[layer]`` (``[2, n*B, H, D]``) on the device.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from kvfs import gpu
from kvfs.kv.block import verify_layers

if TYPE_CHECKING:
    import torch

    from kvfs.kv.blockio import Backing
    from kvfs.kv.loader import BlockPlan


class LayerLoads:
    """Mixin of :class:`kvfs.kv.loader.Loader` (uses its layout, lock, pool, leases,
    ``_open_checked`` and ``_host_buffer``)."""
    def iter_layers(self, plans: list[BlockPlan], out: torch.Tensor, *,
                    held: list[Backing | None] | None = None):
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
            backings, own = self._lease_or_held(plans, held)
            leased = backings if own else None        # released below only when ours
            backings = backings + [None] * (len(plans) - len(backings))
            try:
                opened = list(self._pool.map(self._open_checked, plans, backings))
            except BaseException:
                self._release(leased)
                raise
            try:
                bufs = [self._host_buffer(n * lb, copier.cuda) for _ in range(2)]
                try:
                    yield from self._layers_gen(opened, bufs, out, copier)
                finally:
                    for b in bufs:
                        b.close()
            finally:
                for blk, _ in opened:
                    blk.close()
                self._release(leased)

    def _read_layer(self, opened, layer: int, st, blocks: range | None = None) -> None:
        lb = self.layout.layer_bytes
        for i in blocks if blocks is not None else range(len(opened)):
            blk, info = opened[i]
            dst = st.buf.mv[i * lb:(i + 1) * lb]
            blk.pread_into(dst, info.data_offset + layer * lb, lb)
            if not blk.trusted:
                verify_layers(info, dst, self.layout, blk.path, layers=range(layer, layer + 1))

    def _layers_gen(self, opened, bufs, out, copier):
        lay = self.layout
        n, L = len(opened), lay.num_layers
        shape = (n, 2, lay.block_tokens, lay.num_kv_heads, lay.head_dim)
        toks = [None, None]
        scratch = copier.scratch(shape, lay.torch_dtype)   # same stream: one serves every layer
        # one layer of every block: its slices dealt to the readers (a layer of n blocks is n
        # small reads; one thread for all of them held loads at 0.03x of H2D on an H200)
        groups = min(self.readers, n)

        def submit(layer: int, st) -> list:
            return [self._pool.submit(self._read_layer, opened, layer, st, range(g, n, groups))
                    for g in range(groups)]

        futs = {0: submit(0, bufs[0])}
        try:
            for layer in range(L):
                st = bufs[layer % 2]
                done = futs.pop(layer)
                for f in done:          # all of them end before an error is raised: the
                    f.exception()       # buffer is not reused or freed under a reader
                for f in done:
                    f.result()
                if layer + 1 < L:
                    nb = (layer + 1) % 2
                    copier.wait(toks[nb])
                    futs[layer + 1] = submit(layer + 1, bufs[nb])
                src = st.tensor[:n * lay.layer_bytes].view(lay.torch_dtype).view(shape)
                # [n, 2, B, H, D] -> out[layer]: [2, n*B, H, D]
                dst = out[layer].unflatten(1, (n, lay.block_tokens))
                toks[layer % 2] = copier.copy_transposed(dst, src, scratch, pinned=st.pinned)
                copier.publish(toks[layer % 2])
                yield layer
        finally:
            for f in (f for fs in futs.values() for f in fs):
                try:
                    f.result()
                except BaseException:
                    pass
            for t in toks:
                copier.wait(t)
