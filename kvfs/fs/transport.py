"""Which FUSE transport serves a mount: kvfs's own (kvfs/fs/session.py: FUSE passthrough) or
pyfuse3 (libfuse 3.14: neither passthrough nor io_uring), chosen once at mount.

``transport = "auto"`` (the default) takes kvfs's own wherever it can run (a root daemon on a
kernel with protocol 7.36+) and falls back to pyfuse3 otherwise, saying why in the log and in
``.kvfs/stats`` (``transport``); ``"kernel"`` refuses to mount where it cannot run,
``"pyfuse3"`` always takes the fallback. Passthrough is then on only where the kernel
negotiated it (Linux 6.9+) and ``passthrough = true`` (the default).
"""
from __future__ import annotations

import logging

import pyfuse3

from kvfs.errors import ConfigError
from kvfs.fs import loop
from kvfs.fs.session import KernelSession, unavailable

log = logging.getLogger(__name__)


class Pyfuse3Transport:
    """The fallback: pyfuse3's session with kvfs's request loop (kvfs/fs/loop.py)."""

    name = "pyfuse3"

    def __init__(self, ops, mountpoint: str, options: set[str], why: str):
        self.ops, self.mountpoint, self.options, self.why = ops, mountpoint, options, why

    def mount(self) -> None:
        pyfuse3.init(self.ops, self.mountpoint, self.options)

    async def serve(self, reader: loop.Reader) -> None:
        await loop.serve(reader)

    def terminate(self) -> None:
        pyfuse3.terminate()

    def close(self, unmount: bool = True) -> None:
        pyfuse3.close(unmount=unmount)

    def notify_direct(self):
        return None

    def statistics(self) -> dict:
        return {"name": self.name, "why": self.why,
                "passthrough": {"state": "off (the pyfuse3 transport cannot negotiate it)"},
                "data_reads": self.ops.data_reads}     # every READ of a file reaches us here


class KernelTransport(KernelSession):
    name = "kernel"

    def notify_direct(self):
        return self.handlers.notify


def choose(cfg, ops, mountpoint: str, options: set[str]):
    """The transport ``cfg.transport`` asks for (see the module's text)."""
    if cfg.transport == "pyfuse3":
        return Pyfuse3Transport(ops, mountpoint, options, "chosen: transport = pyfuse3")
    why = unavailable()
    if why is None:
        return KernelTransport(ops, mountpoint, options, passthrough=cfg.passthrough,
                               writeback_cache=cfg.writeback_cache)
    if cfg.transport == "kernel":
        raise ConfigError(f"transport = kernel cannot run here: {why}")
    log.warning("FUSE transport: pyfuse3 (kvfs's own cannot run: %s); no passthrough", why)
    return Pyfuse3Transport(ops, mountpoint, options, why)
