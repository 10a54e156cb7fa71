"""kvfs's request loop: pyfuse3's own worker loop, without a scheduler pass per request.

pyfuse3 reads requests in worker tasks (``_session_loop``): each takes a ``trio.Lock``, waits
until ``/dev/fuse`` is readable, reads one request, gives the lock to the next worker and
runs the handler. On a busy mount that costs, for every request, a hand-over of the lock
(the next worker is woken and runs once), an epoll registration and a full pass of trio's
scheduler — about as much as a short handler (benchmarks/create_cpu.py, docs/benchmarks.md).

pyfuse3 reaches trio only through its module attribute ``pyfuse3.trio`` (so that
``pyfuse3.asyncio`` can swap it); :func:`serve` runs ``pyfuse3.main`` with that attribute
pointing at a facade that is trio except for two things:

- ``Lock`` (pyfuse3's read lock only) lets the task that releases it take it again at
  once: a release wakes one waiter (at most one at a time) instead of handing it the lock,
  so a worker whose handler did not wait goes on to the next request; a worker whose handler
  waits leaves the lock free, and the woken waiter reads the next request meanwhile (as
  before: one slow request never holds up the others);
- ``lowlevel.wait_readable`` returns at once when a request is already queued (``poll`` with
  no timeout), up to ``burst`` times in a row; then it waits through trio as before, which
  lets every other task (the index committer, timers, threads' results) run. A request that
  is not queued yet is always waited for through trio.

kvfs's own transport (kvfs/fs/session.py) reads through :meth:`Reader.readv` the same way, and
can spin (config ``fuse_spin_us``, off): right after a request, up to that many microseconds of
retried reads, a trio checkpoint between two, before it waits through trio (:meth:`Reader.spin`).

Everything else (nursery, current task, ``notify_closing`` at ``pyfuse3.terminate``, the
cancellation of the loop at unmount) is trio's own.
"""
from __future__ import annotations

import importlib.metadata
import itertools
import logging
import os
import select
import time

import pyfuse3
import trio

log = logging.getLogger(__name__)

BURST = 8           # requests read without a scheduler pass in between
# pyfuse3 versions this loop is tested with (pyproject.toml pins the same range): the facade
# replaces what pyfuse3's worker loop takes from its ``trio`` attribute, so another release,
# whose loop may take other things or in another way, is refused at mount (binding_problem)
TESTED = ((3, 5), (3, 6))           # >= 3.5, < 3.6


def _numbers(version: str) -> tuple[int, ...]:
    out = []
    for part in version.split("."):
        digits = "".join(itertools.takewhile(str.isdigit, part))
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def binding_problem(version: str | None = None) -> str | None:
    """None when the installed pyfuse3 (or ``version``) is one the loop is tested with and
    has the shape it hooks (a ``trio`` module attribute that is trio, ``main``, ``init``);
    otherwise the reason, one line."""
    if version is None:
        try:
            version = importlib.metadata.version("pyfuse3")
        except importlib.metadata.PackageNotFoundError:
            version = getattr(pyfuse3, "__version__", "unknown")
    lo, hi = TESTED
    want = f">={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}"
    if not lo <= _numbers(version)[:2] < hi:
        return (f"kvfs's request loop is tested with pyfuse3 {want}, not {version}: "
                f"install pyfuse3{want} (pip install 'pyfuse3{want}')")
    if getattr(pyfuse3, "trio", None) is not trio or not callable(getattr(pyfuse3, "main", None)):
        return f"pyfuse3 {version} does not reach trio through its 'trio' attribute: kvfs's request loop cannot hook it"
    return None


class ReadLock:
    """pyfuse3's read lock: one worker at a time waits for and reads a request. Not fair: a
    release wakes a waiter, but the lock goes to whichever worker asks first (the releaser,
    when its handler did not wait; the woken worker otherwise)."""

    __slots__ = ("_held", "_lot", "_waking")

    def __init__(self):
        self._held = False
        self._lot = trio.lowlevel.ParkingLot()
        self._waking = False        # a waiter was woken and has not run yet

    async def acquire(self) -> None:
        while self._held:
            try:
                await self._lot.park()
            except BaseException:           # cancelled: the wake it may have had goes on
                self._waking = False
                if not self._held:
                    self._wake()
                raise
            self._waking = False
        self._held = True

    __aenter__ = acquire

    async def __aexit__(self, *exc) -> None:
        self.release()

    def try_acquire(self) -> bool:
        """Take the lock if it is free, without a checkpoint (as ``__aenter__`` does then)."""
        if self._held:
            return False
        self._held = True
        return True

    def release(self) -> None:
        self._held = False
        self._wake()

    def _wake(self) -> None:
        if self._lot and not self._waking:
            self._waking = True
            self._lot.unpark()


class Reader:
    """``wait_readable`` for pyfuse3's session descriptor (see the module's text)."""

    def __init__(self, burst: int = BURST, spin_us: int = 0):
        self.burst = burst
        self.spin_ns = max(0, int(spin_us)) * 1000
        self._armed = False     # a request was read since the last spin: the next EAGAIN may spin
        self.spins = self.spun = self.spin_missed = 0
        self.clock = time.perf_counter_ns   # the spin's clock (a test's may stand still)
        self._streak = 0
        self._poll = None
        self._fd = -1
        self.fast = self.waited = 0     # requests read at once / waited for through trio

    async def wait_readable(self, fd) -> None:
        if self._streak < self.burst:
            if fd != self._fd:
                self._poll, self._fd = select.poll(), fd
                self._poll.register(fd, select.POLLIN)
            ev = self._poll.poll(0)
            if ev and ev[0][1] == select.POLLIN:
                self._streak += 1
                self.fast += 1
                await trio.lowlevel.checkpoint_if_cancelled()
                return
        self._streak = 0
        self.waited += 1
        await trio.lowlevel.wait_readable(fd)

    async def readv(self, fd: int, view) -> int:
        """One request read from ``fd`` (non-blocking) into ``view``: kvfs's own transport
        (kvfs/fs/session.py). The same turns as :meth:`wait_readable` without its ``poll``:
        up to ``burst`` reads in a row are tried at once (a queued request costs one
        ``readv``, an empty queue one EAGAIN), then, right after a request only, up to
        ``spin_us`` of retried reads (:meth:`spin`), then a wait through trio.
        BlockingIOError when the request went to another reader meanwhile."""
        if self._streak < self.burst:
            await trio.lowlevel.checkpoint_if_cancelled()      # before the read: none is lost
            try:
                n = os.readv(fd, [view])
            except BlockingIOError:
                if self._armed:
                    n = await self.spin(fd, view)
                    if n is not None:
                        return n
            else:
                self._streak += 1
                self.fast += 1
                self._armed = self.spin_ns > 0
                return n
        self._streak = 0
        self.waited += 1
        await trio.lowlevel.wait_readable(fd)
        self._armed = self.spin_ns > 0
        return os.readv(fd, [view])

    async def spin(self, fd: int, view) -> int | None:
        """Retry the non-blocking read for up to ``spin_us`` (the request after the one just
        answered often comes within tens of microseconds: the caller's next call), so that it
        costs no sleep in epoll and no wake-up. Only right after a request (at most one window
        per request: an idle daemon never spins). Between two tries a trio checkpoint: trio's
        other tasks, threads' results, timers and descriptors go on as before (each pass polls
        epoll without waiting), and the spin is a cancellation point. None when nothing came
        (the caller waits through trio)."""
        self._armed = False
        self.spins += 1
        clock, readv = self.clock, os.readv
        end = clock() + self.spin_ns
        while True:
            try:
                n = readv(fd, [view])
            except BlockingIOError:
                pass
            else:
                self._streak += 1
                self.spun += 1
                self._armed = True
                return n
            if clock() >= end:
                self.spin_missed += 1
                return None
            await trio.lowlevel.checkpoint()

    def statistics(self) -> dict:
        """What ``.kvfs/stats`` shows as ``request_loop``."""
        out = {"burst": self.burst, "read_at_once": self.fast, "waited": self.waited}
        if self.spin_ns:
            out.update(spin_us=self.spin_ns // 1000, spins=self.spins, read_spinning=self.spun,
                       spin_missed=self.spin_missed)
        return out


class _Over:
    """A module with some attributes replaced; every other name is the module's own (so a
    pyfuse3 that asks trio for something more still gets trio's)."""

    def __init__(self, base, **replaced):
        self._base = base
        self.__dict__.update(replaced)

    def __getattr__(self, name):
        return getattr(self._base, name)


def facade(reader: Reader) -> _Over:
    """What pyfuse3 sees as ``trio`` while :func:`serve` runs."""
    return _Over(trio, Lock=ReadLock, lowlevel=_Over(trio.lowlevel, wait_readable=reader.wait_readable))


async def serve(reader: Reader | None = None) -> None:
    """``pyfuse3.main()`` through the facade (after ``pyfuse3.init``)."""
    reader = reader or Reader()
    saved = pyfuse3.trio
    pyfuse3.trio = facade(reader)
    try:
        await pyfuse3.main()
    finally:
        pyfuse3.trio = saved
        log.debug("request loop: %d requests read at once, %d waited for", reader.fast, reader.waited)
