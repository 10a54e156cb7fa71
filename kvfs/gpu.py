"""Device helpers for the KV loader: pinned staging, copies on a side stream, optional GDS.

Everything degrades to plain CPU tensors when CUDA is absent: ``DeviceCopier`` then copies
synchronously and ``pin`` is a no-op. Imports torch on first use only.
"""
from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)


def _torch():
    import torch
    return torch


def cuda_available() -> bool:
    try:
        return _torch().cuda.is_available()
    except ImportError:
        return False


def device_of(device) -> "object":
    torch = _torch()
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {device!r} requested but CUDA is not available")
    return dev


def host_empty(shape, dtype):
    """An uninitialised CPU tensor whose storage starts on a page boundary (an anonymous
    mapping): the kernel copies file bytes into page-aligned memory 2-3x faster than into
    the 64-byte-aligned memory ``torch.empty`` returns. The mapping lives as long as the tensor."""
    import mmap
    torch = _torch()
    n = 1
    for d in shape:
        n *= d
    nbytes = n * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mm, dtype=torch.uint8).view(dtype).view(shape)


def buffer_address(buf) -> int:
    """Address of a writable buffer (mmap, bytearray)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


class PinnedRegistration:
    """cudaHostRegister of an existing page-aligned buffer (so H2D copies can be async)."""

    def __init__(self, buf, size: int):
        self.ptr = 0
        if not cuda_available():
            return
        torch = _torch()
        ptr = buffer_address(buf)
        err = torch.cuda.cudart().cudaHostRegister(ptr, size, 0)
        code = getattr(err, "value", err)
        if code != 0:
            log.warning("cudaHostRegister(%d bytes) failed with %s; copies will be synchronous", size, err)
            return
        self.ptr = ptr

    @property
    def pinned(self) -> bool:
        return self.ptr != 0

    def close(self) -> None:
        if self.ptr:
            _torch().cuda.cudart().cudaHostUnregister(self.ptr)
            self.ptr = 0


_INT_OF_SIZE = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def as_numpy(t):
    """A numpy view of a CPU tensor's bytes (any dtype, strides kept)."""
    torch = _torch()
    return t.view(getattr(torch, _INT_OF_SIZE[t.element_size()])).numpy()


class DeviceCopier:
    """Copies host staging tensors into a destination tensor, overlapped on a CUDA stream.

    ``copy`` returns a token; ``wait(token)`` blocks until that copy finished (so its
    staging buffer can be reused); ``finish()`` makes the caller's current stream wait for
    every copy issued so far.
    """

    def __init__(self, device):
        torch = _torch()
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(device=self.device) if self.cuda else None
        if self.cuda:
            # the destination may still be read by work queued on the caller's stream (a
            # runtime reusing its KV buffer): the copies start after that work
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def copy(self, dst, src, *, pinned: bool = False):
        if not self.cuda:
            if dst.device.type == "cpu" and src.device.type == "cpu" and dst.dtype == src.dtype:
                # numpy copies on this thread without the GIL; torch's intra-op threads would
                # spin on the cores the reader threads and the kvfs daemon need
                import numpy as np
                np.copyto(as_numpy(dst), as_numpy(src))
            else:
                dst.copy_(src)
            return None
        torch = _torch()
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=pinned)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        return ev

    def copy_transposed(self, dst, src, scratch, *, pinned: bool = False):
        """``dst.copy_(src.transpose(0, 1))`` for a contiguous host ``src``: on CUDA the bytes
        cross as one contiguous copy into ``scratch`` (a device tensor shaped like ``src``)
        and are permuted on the device (torch would permute on the CPU, into pageable memory,
        first: layer-by-layer loads ran at 0.02x of H2D on an H200)."""
        if not self.cuda:
            return self.copy(dst, src.transpose(0, 1), pinned=pinned)
        torch = _torch()
        with torch.cuda.stream(self.stream):
            scratch.copy_(src, non_blocking=pinned)
            dst.copy_(scratch.transpose(0, 1))
            ev = torch.cuda.Event()
            ev.record(self.stream)
        return ev

    def scratch(self, shape, dtype):
        """A device tensor for ``copy_transposed`` (None off CUDA), allocated on the copy stream."""
        if not self.cuda:
            return None
        torch = _torch()
        with torch.cuda.stream(self.stream):
            return torch.empty(shape, dtype=dtype, device=self.device)

    @staticmethod
    def wait(token) -> None:
        if token is not None:
            token.synchronize()

    def finish(self) -> None:
        if self.cuda:
            _torch().cuda.current_stream(self.device).wait_stream(self.stream)

    def publish(self, token) -> None:
        """Make the current stream wait for one copy (layer-by-layer consumers)."""
        if token is not None:
            _torch().cuda.current_stream(self.device).wait_event(token)


def kvikio_available() -> bool:
    try:
        import kvikio  # noqa: F401
    except ImportError:
        return False
    return cuda_available()


def gds_read(path: str, dst, offset: int, nbytes: int) -> int:
    """Read ``nbytes`` at ``offset`` of ``path`` straight into the CUDA tensor ``dst`` (GDS)."""
    import kvikio
    with kvikio.CuFile(path, "r") as f:
        n = f.pread(dst, nbytes, offset).get()
    if n != nbytes:
        raise OSError(f"{path}: GDS short read ({n} of {nbytes} bytes)")
    return n
