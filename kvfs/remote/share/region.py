"""A window of a shared volume: one data region, seen by RemoteTier as a volume of its own.

Reads, writes and flushes go to the parent volume at the region's offset; availability,
reconnection and status are the parent's. The format-1 layout (superblock, allocation table,
records) inside the region is exactly what a single-node volume holds.
"""
from __future__ import annotations

from typing import Awaitable, Callable

from kvfs.remote.volume import Volume


class RegionVolume(Volume):
    def __init__(self, parent: Volume, offset: int, size: int):
        super().__init__()
        self.parent = parent
        self.offset = offset
        self.size = size
        self.block_size = parent.block_size
        self.describe = parent.describe
        self.guard: Callable[[], None] | None = None     # raises when the owner may not write now

    @property
    def available(self) -> bool:
        return self.parent.available

    @property
    def errors(self) -> int:
        return self.parent.errors

    @errors.setter
    def errors(self, v: int) -> None:
        pass

    @property
    def last_error(self) -> str:
        return self.parent.last_error

    @last_error.setter
    def last_error(self, v: str) -> None:
        pass

    @property
    def reconnects(self) -> int:
        return self.parent.reconnects

    @reconnects.setter
    def reconnects(self, v: int) -> None:
        pass

    async def open(self) -> None:
        pass                        # the parent is opened (and the region claimed) by the share tier

    async def close(self) -> None:
        await self.parent.close()

    async def serve(self, on_reconnect: Callable[[], Awaitable[None]] | None = None) -> None:
        await self.parent.serve(on_reconnect)

    def buffer(self, size: int):
        return self.parent.buffer(size)

    def _check(self, offset: int, length: int) -> None:
        if offset < 0 or offset + length > self.size:
            raise ValueError(f"region I/O [{offset}, +{length}) outside the region of {self.size} bytes")

    async def read(self, offset: int, length: int) -> memoryview:
        self._check(offset, length)
        return await self.parent.read(self.offset + offset, length)

    async def _write(self, offset: int, data: memoryview) -> None:
        self._check(offset, len(data))
        if self.guard is not None:
            self.guard()
        await self.parent._write(self.offset + offset, data)

    async def _flush(self) -> None:
        await self.parent._flush()

    async def write(self, offset: int, data) -> int:
        self._check(offset, len(memoryview(data).cast("B")))
        if self.guard is not None:
            self.guard()
        return await self.parent.write(self.offset + offset, data)

    async def durable(self, generation: int) -> None:
        await self.parent.durable(generation)

    def status(self) -> dict:
        return self.parent.status()

    def identity(self) -> dict:
        return self.parent.identity()
