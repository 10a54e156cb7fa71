"""kvfs's request loop (kvfs.fs.loop): pyfuse3's read lock and its wait for the session
descriptor, driven in one trio run (a pipe stands in for /dev/fuse), and the facade pyfuse3
sees while the loop serves. The mount tests run every request through it."""
from __future__ import annotations

import os

import pyfuse3
import pytest
import trio
import trio.testing

from kvfs.fs import loop


async def test_lock_lets_one_holder_in_at_a_time():
    lock, inside, most, done = loop.ReadLock(), 0, 0, []

    async def worker(i):
        nonlocal inside, most
        for _ in range(20):
            async with lock:
                inside += 1
                most = max(most, inside)
                await trio.sleep(0)          # a wait while holding it (the slow wait for a request)
                inside -= 1
            await trio.sleep(0)             # a handler that waits
        done.append(i)

    async with trio.open_nursery() as n:
        for i in range(5):
            n.start_soon(worker, i)
    assert most == 1 and sorted(done) == list(range(5))


async def test_releaser_takes_it_again_and_a_woken_waiter_gets_it_when_the_releaser_waits():
    lock, order = loop.ReadLock(), []

    async def waiter():
        async with lock:
            order.append("waiter")

    async with trio.open_nursery() as n:
        await lock.__aenter__()
        n.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()       # parked on the lock
        for _ in range(3):                  # handlers that did not wait: no hand-over, no pass
            await lock.__aexit__(None, None, None)
            await lock.__aenter__()
            order.append("releaser")
        await lock.__aexit__(None, None, None)
        await trio.sleep(0)                 # now the releaser's handler waits
        await trio.testing.wait_all_tasks_blocked()
    assert order == ["releaser"] * 3 + ["waiter"]


async def test_a_waiter_cancelled_while_parked_leaves_the_wake_to_the_next():
    lock, got = loop.ReadLock(), []

    async def waiter(name, scope_out):
        with trio.CancelScope() as scope:
            scope_out.append(scope)
            async with lock:
                got.append(name)

    async with trio.open_nursery() as n:
        await lock.__aenter__()
        s1, s2 = [], []
        n.start_soon(waiter, "first", s1)
        await trio.testing.wait_all_tasks_blocked()
        n.start_soon(waiter, "second", s2)
        await trio.testing.wait_all_tasks_blocked()
        s1[0].cancel()
        await trio.testing.wait_all_tasks_blocked()
        await lock.__aexit__(None, None, None)
        await trio.testing.wait_all_tasks_blocked()
    assert got == ["second"]


@pytest.fixture
def pipe():
    r, w = os.pipe()
    yield r, w
    os.close(r)
    os.close(w)


async def test_a_queued_request_is_read_without_a_scheduler_pass_up_to_the_burst(pipe):
    r, w = pipe
    reader, ran = loop.Reader(burst=4), []

    async def other():                      # runs only when the reader lets the scheduler in
        ran.append(True)

    os.write(w, b"x")                       # a request is queued (it stays: nothing reads it)
    async with trio.open_nursery() as n:
        n.start_soon(other)
        for _ in range(4):
            await reader.wait_readable(r)
        assert (reader.fast, reader.waited, ran) == (4, 0, [])     # no pass: other never ran
        await reader.wait_readable(r)       # the fifth goes through trio
        assert (reader.fast, reader.waited) == (4, 1)
        for _ in range(4):                  # then a new burst
            await reader.wait_readable(r)
        assert (reader.fast, reader.waited) == (8, 1)
    assert ran == [True]


async def test_a_request_not_queued_yet_is_waited_for_through_trio(pipe):
    r, w = pipe
    reader = loop.Reader()

    async def later():                      # runs only once the reader waits through trio
        os.write(w, b"x")

    async with trio.open_nursery() as n:
        n.start_soon(later)
        await reader.wait_readable(r)
    assert (reader.fast, reader.waited) == (0, 1)
    assert os.read(r, 1) == b"x"


async def test_both_waits_are_cancellation_points(pipe):
    r, w = pipe
    reader = loop.Reader()
    with trio.CancelScope() as scope:
        scope.cancel()
        await reader.wait_readable(r)       # nothing queued: trio's wait
    assert scope.cancelled_caught
    os.write(w, b"x")
    with trio.CancelScope() as scope:
        scope.cancel()
        await reader.wait_readable(r)       # queued: the fast path still checks
    assert scope.cancelled_caught


@pytest.fixture
def nonblocking_pipe(pipe):
    os.set_blocking(pipe[0], False)
    return pipe


async def test_readv_reads_queued_requests_at_once_up_to_the_burst(nonblocking_pipe):
    r, w = nonblocking_pipe
    reader, ran, buf = loop.Reader(burst=2), [], bytearray(8)

    async def other():                      # runs only when the reader lets the scheduler in
        ran.append(True)

    os.write(w, b"abcdefgh")
    async with trio.open_nursery() as n:
        n.start_soon(other)
        assert [await reader.readv(r, memoryview(buf)[:1]) for _ in range(2)] == [1, 1]
        assert (reader.fast, reader.waited, ran) == (2, 0, [])     # no poll, no pass
        assert await reader.readv(r, memoryview(buf)[:1]) == 1     # the third goes through trio
        assert (reader.fast, reader.waited, bytes(buf[:1])) == (2, 1, b"c")
    assert ran == [True]


async def test_readv_of_an_empty_queue_waits_through_trio(nonblocking_pipe):
    r, w = nonblocking_pipe
    reader, buf = loop.Reader(), bytearray(4)

    async def later():                      # runs only once the reader waits through trio
        os.write(w, b"x")

    async with trio.open_nursery() as n:
        n.start_soon(later)
        assert await reader.readv(r, memoryview(buf)) == 1
    assert (reader.fast, reader.waited, bytes(buf[:1])) == (0, 1, b"x")
    with trio.CancelScope() as scope:       # both ways are cancellation points
        scope.cancel()
        await reader.readv(r, memoryview(buf))
    assert scope.cancelled_caught
    os.write(w, b"y")
    with trio.CancelScope() as scope:
        scope.cancel()
        await reader.readv(r, memoryview(buf))
    assert scope.cancelled_caught
    assert os.read(r, 1) == b"y"            # a cancelled read leaves the request queued


class _Root(pyfuse3.Operations):
    """A one-directory filesystem whose GETATTR notes what pyfuse3 calls trio meanwhile."""

    def __init__(self):
        super().__init__()
        self.seen = []

    async def getattr(self, inode, ctx=None):
        self.seen.append(pyfuse3.trio.Lock)
        await trio.sleep(0)                 # a handler that waits: the loop goes on reading
        a = pyfuse3.EntryAttributes()
        a.st_ino, a.st_mode, a.st_nlink = inode, 0o40755, 2
        a.attr_timeout = a.entry_timeout = 0
        return a


async def test_a_real_mount_is_served_through_the_facade_and_pyfuse3_gets_trio_back(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    fs, reader = _Root(), loop.Reader()
    pyfuse3.init(fs, str(mnt), ["fsname=kvfs-loop-test"])
    try:
        async with trio.open_nursery() as n:
            n.start_soon(loop.serve, reader)
            stats = await trio.to_thread.run_sync(
                lambda: [os.stat(mnt).st_ino for _ in range(20)])
            pyfuse3.terminate()
    finally:
        pyfuse3.close(unmount=True)
    assert stats == [pyfuse3.ROOT_INODE] * 20
    assert fs.seen and set(fs.seen) == {loop.ReadLock}
    assert reader.fast + reader.waited >= 20      # pyfuse3 waited through the facade
    assert pyfuse3.trio is trio


def test_the_facade_is_trio_but_for_the_read_lock_and_the_wait():
    reader = loop.Reader()
    f = loop.facade(reader)
    assert f.Lock is loop.ReadLock and f.lowlevel.wait_readable == reader.wait_readable
    for name in ("open_nursery", "ClosedResourceError", "from_thread", "sleep", "CancelScope"):
        assert getattr(f, name) is getattr(trio, name)
    for name in ("current_task", "current_trio_token", "notify_closing", "checkpoint"):
        assert getattr(f.lowlevel, name) is getattr(trio.lowlevel, name)


def test_the_binding_is_checked_against_the_tested_pyfuse3_range(monkeypatch):
    """Issue 32 (5): pyfuse3 is pinned to the range the loop is tested with; another release,
    or one whose loop does not reach trio through its ``trio`` attribute, has a one-line reason."""
    import tomllib
    from pathlib import Path
    assert loop.binding_problem() is None                   # the installed one
    for v in ("3.5.0", "3.5.2", "3.5.0rc1"):
        assert loop.binding_problem(v) is None, v
    for v in ("3.4.0", "3.6.0", "4.0", "unknown"):
        why = loop.binding_problem(v)
        assert why and "\n" not in why and v in why and ">=3.5,<3.6" in why, why
    deps = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]["dependencies"]
    assert "pyfuse3>=3.5,<3.6" in deps, "pyproject.toml pins another range than kvfs.fs.loop.TESTED"
    monkeypatch.setattr(pyfuse3, "trio", object())          # a loop hooked some other way
    why = loop.binding_problem("3.5.0")
    assert why and "\n" not in why and "trio" in why


def test_a_mount_with_another_pyfuse3_is_refused_with_one_line(tmp_path):
    import subprocess
    import sys
    from pathlib import Path
    fake = tmp_path / "site"                                # its metadata first on the path
    (fake / "pyfuse3-3.6.0.dist-info").mkdir(parents=True)
    (fake / "pyfuse3-3.6.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: pyfuse3\nVersion: 3.6.0\n")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    repo = Path(__file__).parents[2]
    env = {**os.environ, "PYTHONPATH": f"{fake}{os.pathsep}{repo}"}
    res = subprocess.run([sys.executable, "-m", "kvfs.cli", "mount", str(mnt), "--nvme", str(tmp_path / "nvme"),
                          "--state", str(tmp_path / "state")], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode != 0 and not os.path.ismount(mnt)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "3.6.0" in lines[0] and "pyfuse3>=3.5,<3.6" in lines[0], res.stderr


class _Clock:
    """The spin's clock: stands still until a test moves it (no test waits on real time)."""

    def __init__(self, step: int = 0):
        self.now, self.step = 0, step

    def __call__(self) -> int:
        self.now += self.step
        return self.now


async def test_an_idle_reader_never_spins_and_spins_once_per_request(nonblocking_pipe):
    r, w = nonblocking_pipe
    reader, buf = loop.Reader(spin_us=50), bytearray(4)
    reader.clock = _Clock(step=10_000)      # each look at the clock: 10 µs later

    async def later(data):                  # runs only once the reader sleeps in trio's wait
        await trio.testing.wait_all_tasks_blocked()
        os.write(w, data)

    async with trio.open_nursery() as n:    # no request read yet: an empty queue is waited for
        n.start_soon(later, b"a")
        assert await reader.readv(r, memoryview(buf)) == 1
    assert (reader.spins, reader.waited) == (0, 1)
    async with trio.open_nursery() as n:    # right after a request: one window, then trio
        n.start_soon(later, b"b")
        assert await reader.readv(r, memoryview(buf)) == 1
    assert (reader.spins, reader.spin_missed, reader.waited, bytes(buf[:1])) == (1, 1, 2, b"b")
    async with trio.open_nursery() as n:    # one window per request, never two in a row
        n.start_soon(later, b"c")
        assert await reader.readv(r, memoryview(buf)) == 1
    assert (reader.spins, reader.waited) == (2, 3)
    assert loop.Reader().spin_ns == 0 and "spins" not in loop.Reader().statistics()   # off by default


async def test_a_spin_lets_trio_run_and_takes_the_request_that_came_meanwhile(nonblocking_pipe):
    r, w = nonblocking_pipe
    reader, buf, ran = loop.Reader(spin_us=50), bytearray(4), []
    reader.clock = _Clock()                 # the window never ends on its own
    os.write(w, b"a")
    assert await reader.readv(r, memoryview(buf)) == 1          # a request: the spin is armed

    async def other():                      # a task runnable during the spin (a committer, say)
        ran.append(True)
        os.write(w, b"b")                   # the caller's next request

    async with trio.open_nursery() as n:
        n.start_soon(other)
        assert await reader.readv(r, memoryview(buf)) == 1
    assert ran == [True] and bytes(buf[:1]) == b"b"
    assert (reader.spins, reader.spun, reader.spin_missed, reader.waited) == (1, 1, 0, 0)
    st = reader.statistics()
    assert (st["spin_us"], st["read_spinning"]) == (50, 1)
    with trio.CancelScope() as scope:       # a cancellation point: an endless window still ends
        scope.cancel()
        await reader.spin(r, memoryview(buf))
    assert scope.cancelled_caught
    os.write(w, b"c")                       # and nothing queued meanwhile was lost
    assert await reader.readv(r, memoryview(buf)) == 1 and bytes(buf[:1]) == b"c"
