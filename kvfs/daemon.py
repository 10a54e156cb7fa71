"""The mount daemon: builds the tiers, index, store and FUSE layer, and serves until unmounted.

Started by ``kvfs mount`` as ``python -m kvfs.daemon --config-json JSON --ready-fd N``.
It writes ``READY <pid>`` to the fd once the mount is up, or ``ERROR <message>``.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import faulthandler
import json
import logging
import os
import signal
import sys
import time

import pyfuse3
import trio

from kvfs.build import (attach_shared, build_kvstore, build_names, build_ops, build_tiers, detach_names,
                        take_session)
from kvfs import mountrecord
from kvfs.config import Config
from kvfs.errors import ConfigError
from kvfs.fs import loop, transport as transports
from kvfs.proc import filesystem_of
from kvfs.protocol import NAMES_BUILDING_KEY, NAMES_STATS_KEY, UNMOUNT_REPORT, UNMOUNT_REPORT_KEY
from kvfs.store.index import Index
from kvfs.store.names import NameTable, build_in_background
from kvfs.store import safedir

log = logging.getLogger(__name__)

READ_AHEAD_KB = 1024
HANDOVER_DRAIN_S = 10.0     # a handover waits this long for the requests read to be answered


class _Ready:
    def __init__(self, fd: int | None):
        self.fd = fd

    def send(self, line: str) -> None:
        if self.fd is None:
            if line.startswith("ERROR"):
                print(f"kvfs: {line[6:]}", file=sys.stderr)
            return
        try:
            os.write(self.fd, (line + "\n").encode())
            os.close(self.fd)
        except OSError:
            pass
        self.fd = None


def _setup_logging(cfg: Config) -> None:
    os.close(safedir.open_private_dir(cfg.state_dir, "state directory"))
    logfile = cfg.state_dir / "kvfs.log"
    os.close(os.open(logfile, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600))
    os.chmod(logfile, 0o600)
    handlers: list[logging.Handler] = [logging.FileHandler(logfile)]
    if cfg.foreground:
        handlers.append(logging.StreamHandler(sys.stderr))
    logging.basicConfig(level=logging.DEBUG if cfg.debug else logging.INFO, handlers=handlers, force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _enable_faulthandler(logfile)


_fault_log = None       # kvfs.log, open for faulthandler for the process's life


def _enable_faulthandler(logfile) -> None:
    """A fatal signal (SIGSEGV, SIGBUS, SIGFPE, SIGABRT, SIGILL) writes the Python traceback of
    every thread to kvfs.log before the daemon dies: without it a crash leaves nothing there."""
    global _fault_log
    try:
        f = open(os.open(logfile, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC), "a")
    except OSError as e:
        log.warning("no fatal-signal tracebacks in %s: %s", logfile, e)
        return
    faulthandler.enable(file=f, all_threads=True)
    if _fault_log is not None:
        _fault_log.close()
    _fault_log = f


def _mount_device(mountpoint: str) -> str | None:
    """major:minor of our mount, from mountinfo (a stat() here would ask ourselves)."""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            if parts[4] == mountpoint and "fuse.kvfs" in line:
                found = parts[2]
    return locals().get("found")


async def _tune_read_ahead(mountpoint: str) -> None:
    """Raise the mount's read-ahead to 1 MiB (1 MiB read requests instead of 128 KiB).

    The kernel sets it from the FUSE INIT reply, which it handles once the session
    serves its first request, so keep checking for a moment after the mount is up.
    """
    dev = _mount_device(mountpoint)
    if dev is None:
        return
    path = f"/sys/class/bdi/{dev}/read_ahead_kb"
    steady = 0
    for _ in range(50):
        await trio.sleep(0.1)
        try:
            with open(path) as f:
                current = int(f.read())
            if current < READ_AHEAD_KB:
                steady = 0
                with open(path, "w") as f:
                    f.write(str(READ_AHEAD_KB))
            else:
                steady += 1
                if steady >= 10:
                    return
        except OSError as e:
            log.info("could not raise read-ahead (%s): %s", path, e)
            return


def mount_options(allow_other: bool) -> set[str]:
    """The FUSE mount options. pyfuse3's default ``default_permissions`` only with
    ``allow_other``: it makes the kernel fetch the parent directory's attributes before every
    create and rename (a round trip each), and without ``allow_other`` only the mounting user
    can reach the mount at all."""
    options = set(pyfuse3.default_options) - {"default_permissions"}
    options.update(("fsname=kvfs", "subtype=kvfs"))
    if allow_other:
        options.update(("allow_other", "default_permissions"))
    return options


async def serve(cfg: Config, ready: _Ready, attach: str | None = None, epoch: int = 0) -> str | None:
    """Serve until unmounted (None) or handed over to the next daemon (``"handover"``)."""
    started = time.monotonic()
    mountpoint = os.path.abspath(cfg.mountpoint)
    holder = safedir.holder_text(mountpoint)
    index = Index(cfg.state_dir, holder=holder)
    _report_unmount(cfg, None)          # the last unmount's goes (the index holds the lock now)
    tiers = build_tiers(cfg, index, holder)
    opened = []
    metrics = None
    try:
        for t in tiers:
            await t.open()
            opened.append(t)
        tiers[1].bind(index.instance_id, cfg.state_dir, bound=index.get_meta(b"nvme_bound") is not None)
        index.put_meta(b"nvme_bound", b"1")
        kvstore = build_kvstore(cfg, index, tiers)
        store = kvstore.store
        recovered = await kvstore.start()
        names = build_names(cfg, index, tiers[0].dir)
        served, reader, session = {"metrics": None}, loop.Reader(spin_us=cfg.fuse_spin_us), []
        describe = lambda: dict(_describe(cfg, mountpoint, tiers, index, names), recovered=recovered,
                                started=started, request_loop=reader.statistics(), **served,
                                transport=session[0].statistics() if session else None)
        ops = build_ops(kvstore, describe)
        if cfg.share:
            await attach_shared(kvstore, tiers, ops)
        if cfg.metrics:
            from kvfs.metrics import MetricsServer
            metrics = MetricsServer(cfg.metrics, kvstore, trio.lowlevel.current_trio_token())
            served["metrics"] = metrics.address
        options = mount_options(cfg.allow_other)
        fuse = transports.choose(cfg, ops, mountpoint, options)
        handover: list = []
        take_session(cfg, fuse, kvstore, ops, served, attach, epoch, options)
        session.append(fuse)
        unmounted = False
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_tune_read_ahead, mountpoint)
                await nursery.start(store.serve)
                await nursery.start(index.serve_commits)
                for t in tiers:
                    nursery.start_soon(t.serve)
                nursery.start_soon(kvstore.sweep_orphans)
                nursery.start_soon(kvstore.leases.serve)
                if names.building:
                    nursery.start_soon(build_in_background, index, names, cfg.names_build_step)
                nursery.start_soon(_on_signals, kvstore.telemetry.events, fuse, handover)
                log.info("mounted %s in %.2fs (%s)", mountpoint, time.monotonic() - started,
                         ", ".join(f"{t.name} {t.capacity}" for t in tiers))
                huge = filesystem_of(tiers[0].dir)[2].get("huge", "never")
                log.info("ram tier in %s (tmpfs%s, huge pages: %s)", tiers[0].dir,
                         " of its own" if tiers[0].mounted else "", huge)
                mountrecord.write(mountpoint, _record(cfg, tiers, index, served.get("supervisor")))
                ready.send(f"READY {os.getpid()}")
                await fuse.serve(reader)
                unmounted = True
                nursery.cancel_scope.cancel()
        finally:
            ops.kernel.stop()
            fuse.close(unmount=not unmounted)
            detach_names(index)             # unmounted: readers stop answering from it now
        log.info("handed over; writing down" if handover else "unmounted; writing down")
        report = await _write_down(cfg, store)
        kvstore.mark_clean()
        _report_unmount(cfg, report)
    finally:
        detach_names(index)
        if metrics is not None:
            metrics.close()
        for t in reversed(opened):
            with contextlib.suppress(Exception):
                await t.close()
        index.close()
        mountrecord.remove(mountpoint, os.getpid())
        log.info("daemon exiting")
    return "handover" if handover else None


def _describe(cfg: Config, mountpoint: str, tiers, index: Index, names: NameTable) -> dict:
    """The daemon's part of ``.kvfs/stats``."""
    return {"pid": os.getpid(), "mountpoint": mountpoint, "state_dir": str(cfg.state_dir),
            "nvme_dir": str(cfg.nvme_dir), "ram_dir": str(tiers[0].dir), "instance": index.instance_id,
            NAMES_STATS_KEY: names.statistics(), NAMES_BUILDING_KEY: names.building, UNMOUNT_REPORT_KEY: 1}


def _record(cfg: Config, tiers, index: Index, supervisor: dict | None = None) -> dict:
    """What ``kvfs umount`` needs once this daemon is dead (kvfs/mountrecord.py): with a
    supervisor, its pid too (the mount lives while the supervisor does)."""
    ram = tiers[0]
    return {"pid": os.getpid(), "supervisor": (supervisor or {}).get("pid"), "state_dir": str(cfg.state_dir), "nvme_dir": str(cfg.nvme_dir),
            "instance": index.instance_id, "shm_dir": str(cfg.shm_dir), "ram_prefix": ram.prefix,
            "ram_dir": str(ram.dir), "ram_tmpfs": str(ram.mounted) if ram.mounted else None}


async def _write_down(cfg: Config, store) -> dict:
    """The clean unmount's write-down of RAM-only objects; returns the unmount report."""
    store.flush_stats()
    n = lost = 0
    if not cfg.volatile_ram:
        n = await store.mover.write_down_volatile()
        lost = store.mover.unkept
        log.info("wrote %d RAM-only objects down", n - lost)
    return {"pid": os.getpid(), "ram_only": n, "lost": lost}


def _report_unmount(cfg: Config, report: dict | None) -> None:
    """``<state>/unmount.json``: what the clean unmount kept, for ``kvfs umount``'s exit status
    (it is not the daemon's parent and cannot wait for its status); None removes it."""
    tmp = cfg.state_dir / (UNMOUNT_REPORT + ".tmp")
    try:
        if report is None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(cfg.state_dir / UNMOUNT_REPORT)
            return
        with open(tmp, "w") as f:
            json.dump(report, f)
        os.replace(tmp, cfg.state_dir / UNMOUNT_REPORT)
    except OSError as e:
        log.error("could not write %s: %s", UNMOUNT_REPORT, e)


async def _on_signals(events, fuse, handover: list) -> None:
    """SIGTERM/SIGINT: unmount. SIGUSR2 (a supervised daemon, ``kvfs restart``): stop reading
    requests, answer those read, and hand the session back to the supervisor."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGUSR2) as signals:
        async for sig in signals:
            if sig == signal.SIGUSR2:
                if not getattr(fuse, "attached", False):
                    log.warning("signal %d: a restart needs a supervised mount; ignored", sig)
                    continue
                log.info("signal %d: handing over to the next daemon", sig)
                handover.append(time.monotonic())
                events.close()
                fuse.drain()
                with trio.move_on_after(HANDOVER_DRAIN_S):
                    await trio.sleep_forever()
                log.warning("requests still in flight after %.0fs of the handover: ending them", HANDOVER_DRAIN_S)
                fuse.terminate()
                return
            log.info("signal %d: unmounting", sig)
            events.close()          # a waiting .kvfs/events read must not hold the session
            if getattr(fuse, "attached", False):
                # the supervisor holds the session: only the unmount ends it (else it would
                # start the next daemon); the write-down follows as at kvfs umount
                from kvfs.fs.mountdev import detach
                detach(fuse.mountpoint)
            fuse.terminate()
            return


def _raise_fd_limit() -> None:
    """Each RAM-tier object is a tmpfs mapping, and Python's mmap keeps a descriptor."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def main(cfg: Config, ready_fd: int | None = None, attach: str | None = None, epoch: int = 0) -> int:
    ready = _Ready(ready_fd)
    os.umask(0o077)         # everything the daemon creates is private to its user
    try:
        _raise_fd_limit()
        cfg.validate()
        if not os.path.exists("/dev/fuse"):
            raise ConfigError("/dev/fuse is missing: load the fuse module or run the container with --device /dev/fuse")
        # attached, the mountpoint is our own mount, which no one serves until we do
        if not attach and not os.path.isdir(cfg.mountpoint):
            raise ConfigError(f"mountpoint {cfg.mountpoint} does not exist or is not a directory")
        _setup_logging(cfg)
        prof_out = os.environ.get("KVFS_PROFILE")     # a developer's profile of the trio thread
        if prof_out:
            import cProfile
            prof = cProfile.Profile()
            try:
                ended = prof.runcall(trio.run, serve, cfg, ready, attach, epoch)
            finally:
                prof.dump_stats(prof_out)
        else:
            ended = trio.run(serve, cfg, ready, attach, epoch)
        if ended == "handover":
            from kvfs.handover import HANDOVER
            return HANDOVER
        return 0
    except ConfigError as e:
        ready.send(f"ERROR {e}")
        return 2
    except Exception as e:      # noqa: BLE001 - report any start-up failure as one line
        log.exception("daemon failed")
        ready.send(f"ERROR {type(e).__name__}: {e}")
        return 1


def _cli() -> int:
    p = argparse.ArgumentParser(prog="kvfs-daemon")
    p.add_argument("--config-json", required=True)
    p.add_argument("--ready-fd", type=int)
    p.add_argument("--attach", metavar="SOCKET", help="take the session from this supervisor (kvfs/supervisor.py)")
    p.add_argument("--epoch", type=int, default=0)
    p.add_argument("--standby", action="store_true",
                   help="modules loaded, wait for the epoch on stdin (the supervisor's standby)")
    a = p.parse_args()
    if a.standby:
        line = sys.stdin.readline()
        if not line.strip():
            return 0                        # the supervisor let it go (or is gone)
        a.epoch = int(line)
    fields = {f.name for f in dataclasses.fields(Config)}
    data = {k: v for k, v in json.loads(a.config_json).items() if k in fields}
    return main(Config(**data), a.ready_fd, a.attach, a.epoch)


if __name__ == "__main__":
    sys.exit(_cli())
