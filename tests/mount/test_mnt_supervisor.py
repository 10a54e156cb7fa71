"""The supervisor (kvfs/supervisor.py, issue 41): the mount outlives its daemon. A daemon killed
with SIGKILL is replaced by a new one on the same ``/dev/fuse`` session: processes that use the
mount see a pause, never ENOTCONN; what the kernel holds of the dead daemon fails cleanly (a
writer's handle: EIO at its next write and at close, and its file is never published); the
supervisor's socket answers only root and only the daemon it started.

Files are made durable first (written, then a clean unmount writes them down to NVMe): a crash
start drops RAM-only objects (docs/design.md, "Durability and crash consistency"), which is
what a restart still costs."""
from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvfs.cli.restart import ask_supervisor
from kvfs.proc import pid_alive
from support.files import content, errno_of, read
from support.mount import EXIT_TIMEOUT, wait_for
from support.users import intruder, reachable  # noqa: F401 - a fixture

pytestmark = pytest.mark.mount

KiB = 1 << 10
FILES = 8
SIZE = 200 * KiB

# a workload process: stat + read of every file in a loop until told to stop; every error is
# counted by errno name, every read compared with the file's bytes
LOOPER = r"""
import errno, hashlib, json, os, sys
root, want, progress, stop = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4]
errors, wrong, rounds = {}, 0, 0
while not os.path.exists(stop):
    for name, digest in want.items():
        p = os.path.join(root, name)
        try:
            os.stat(p)
            with open(p, "rb") as f:
                data = f.read()
            if hashlib.sha256(data).hexdigest() != digest:
                wrong += 1
        except OSError as e:
            key = errno.errorcode.get(e.errno, str(e.errno))
            errors[key] = errors.get(key, 0) + 1
    rounds += 1
    with open(progress + ".tmp", "w") as f:
        f.write(str(rounds))
    os.replace(progress + ".tmp", progress)
print(json.dumps({"errors": errors, "wrong": wrong, "rounds": rounds}))
"""


def _durable_files(m) -> dict[str, bytes]:
    """FILES sealed files, written down to NVMe by a clean unmount, mounted again."""
    d = m.path / "kv"
    d.mkdir()
    data = {}
    for i in range(FILES):
        data[f"kv/f{i}"] = content(f"f{i}", SIZE + i)
        (m.path / f"kv/f{i}").write_bytes(data[f"kv/f{i}"])
    m.remount()
    _track(m)
    return data


def _track(m) -> dict:
    """The mount's stats; its daemon's and supervisor's pids go to the fixture's cleanup."""
    st = m.stats()
    m.pid = int(st["pid"])
    m._pids.add(m.pid)
    sup = st.get("supervisor") or {}
    if sup.get("pid"):
        m._pids.add(int(sup["pid"]))
    return st


def _kill_daemon(m) -> int:
    """SIGKILL the serving daemon; returns the pid of the one that replaced it."""
    old = m.pid
    os.kill(old, signal.SIGKILL)
    wait_for(lambda: not pid_alive(old), EXIT_TIMEOUT, f"daemon {old} to die")
    # .kvfs/stats is itself served by the mount: this read waits through the pause
    wait_for(lambda: int(m.stats()["pid"]) != old, EXIT_TIMEOUT, "a new daemon to serve")
    _track(m)
    return m.pid


def _wait_rounds(progress: Path, at_least: int, proc) -> None:
    def done():
        assert proc.poll() is None, proc.communicate()
        try:
            return int(progress.read_text() or 0) >= at_least
        except (OSError, ValueError):
            return False
    wait_for(done, EXIT_TIMEOUT, f"the workload's round {at_least}")


def test_kill9_of_the_daemon_is_a_pause_not_enotconn(kvfs_mount, tmp_path):
    import hashlib
    m = kvfs_mount(supervise=True)
    first = _track(m)
    assert first["supervisor"]["epoch"] == 1 and first["supervisor"]["restarts"] == 0
    data = _durable_files(m)
    held_name = "kv/f0"
    held = os.open(m.path / held_name, os.O_RDONLY)      # a runtime's open descriptor
    try:
        assert os.pread(held, SIZE, 0) == data[held_name]
        want = {k: hashlib.sha256(v).hexdigest() for k, v in data.items() if k != held_name}
        progress, stop = tmp_path / "progress", tmp_path / "stop"
        proc = subprocess.Popen([sys.executable, "-c", LOOPER, str(m.path), json.dumps(want), str(progress),
                                 str(stop)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            _wait_rounds(progress, 3, proc)
            before = int(progress.read_text())
            old = m.pid
            new = _kill_daemon(m)
            assert new != old
            _wait_rounds(progress, before + 3, proc)      # it went on after the pause
        finally:
            stop.touch()
            out, err = proc.communicate(timeout=EXIT_TIMEOUT)
        assert proc.returncode == 0, err
        seen = json.loads(out)
        assert seen["errors"] == {}, f"the workload saw errors across the restart: {seen}\n{m.log_tail()}"
        assert seen["wrong"] == 0
        # the descriptor opened before the kill still reads its bytes (passthrough: the
        # kernel reads the backing file it holds; a handle the new daemon would have to
        # serve answers EIO instead, never other bytes)
        if first["transport"]["passthrough"]["state"] == "on":
            assert os.pread(held, SIZE, 0) == data[held_name]
            # a new open of the inode the old descriptor holds in passthrough: the kernel
            # refuses (EIO) one that names another backing file, so the new daemon took the
            # dead one's registration over (its journal, kept by the supervisor)
            assert read(m.path / held_name) == data[held_name]
            assert m.stats()["transport"]["passthrough"]["adopted"] >= 1
        else:
            with pytest.raises(OSError) as e:
                os.pread(held, SIZE, 0)
            assert e.value.errno == errno.EIO
    finally:
        os.close(held)                  # a reader's close through a dead daemon's handle: 0
    st = m.stats()
    sup = st["supervisor"]
    assert sup["epoch"] == 2 and sup["restarts"] == 1, sup
    last = sup["history"][-1]
    assert last["cause"].startswith("signal 9"), last
    assert last["resend"] == "sent" and last["pause_s"] > 0, last
    assert st["transport"]["resend"] == "sent" and st["transport"]["epoch"] == 2
    for name, body in data.items():
        assert read(m.path / name) == body


def test_a_writer_in_flight_gets_eio_and_its_file_is_never_published(kvfs_mount):
    m = kvfs_mount(supervise=True)
    data = _durable_files(m)
    target = m.path / "kv/f1"
    new = m.path / "kv/new.bin"
    ramonly = m.path / "kv/ramonly.bin"         # sealed after the remount: its only copy in RAM
    ramonly.write_bytes(content("ram", SIZE))
    assert os.stat(ramonly).st_size == SIZE     # the kernel caches its entry and attributes
    over = os.open(target, os.O_WRONLY | os.O_TRUNC)          # a new version of an old file
    fresh = os.open(new, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for fd in (over, fresh):
            os.write(fd, content("partial", 300 * KiB))
        m.stats()                   # a read of the stats commits the index: new.bin is in it
        _kill_daemon(m)
        for fd in (over, fresh):
            with pytest.raises(OSError) as e:
                os.write(fd, b"more")
            assert e.value.errno == errno.EIO
    finally:
        for fd in (over, fresh):
            with pytest.raises(OSError) as e:
                os.close(fd)            # close(2) says what was written is lost
            assert e.value.errno == errno.EIO
    assert read(target) == data["kv/f1"]          # the sealed version, not the torn one
    with pytest.raises(OSError) as e:
        read(new)
    assert e.value.errno in (errno.ENOENT, errno.ESTALE)
    assert "new.bin" not in os.listdir(m.path / "kv")
    # the crash start dropped the RAM-only file (lost with the daemon) and told the kernel,
    # which would otherwise show its cached entry and attributes for an hour
    wait_for(lambda: errno_of(os.stat, ramonly) == errno.ENOENT, EXIT_TIMEOUT, "the lost name to go")
    assert "names dropped by the crash start invalidated in the kernel" in (m.state / "kvfs.log").read_text()


def test_the_socket_refuses_a_peer_not_root_and_a_second_daemon(kvfs_mount, intruder):  # noqa: F811
    m = kvfs_mount(supervise=True)
    _track(m)
    sock = m.state / "supervisor.sock"
    assert sock.stat().st_mode & 0o777 == 0o600
    code = ("import json, socket, sys\n"
            "s = socket.socket(socket.AF_UNIX)\n"
            "try:\n"
            "    s.connect(sys.argv[1])\n"
            "except OSError as e:\n"
            "    print('connect', e.errno); sys.exit(0)\n"
            "try:\n"
            "    s.sendall(b'{\"op\": \"attach\", \"options\": []}\\n')\n"
            "except BrokenPipeError:\n"
            "    pass                    # refused before it asked: the answer is read below\n"
            "print(s.recv(4096).decode().strip())\n")
    # as it is: the socket and the state directory keep the other user out
    res = intruder.run(code, sock)
    assert res.stdout.strip() == f"connect {errno.EACCES}", res.stdout
    # opened to everyone: the peer's credentials still refuse it, and no descriptor is sent
    modes = [(m.state, m.state.stat().st_mode & 0o7777), (sock, 0o600)]
    try:
        with reachable(m.state):
            os.chmod(sock, 0o666)
            res = intruder.run(code, sock)
    finally:
        for p, mode in modes:
            os.chmod(p, mode)
    answer = json.loads(res.stdout)
    assert answer["ok"] is False and "not root" in answer["why"], answer
    # root, but not the daemon the supervisor started: refused (a second daemon never gets it)
    answer = ask_supervisor(str(m.state), {"op": "attach", "options": []})
    assert answer["ok"] is False and "not the daemon" in answer["why"], answer
    assert "refused a daemon it did not start" in (m.state / "kvfs.log").read_text()
    assert int(m.stats()["pid"]) == m.pid                      # the mount still served by its own


def test_kvfs_restart_hands_over_without_an_error_and_keeps_ram_only_files(kvfs_mount, kvfs_cli, tmp_path):
    import hashlib
    m = kvfs_mount(supervise=True)
    _track(m)
    (m.path / "kv").mkdir()
    data = {}
    for i in range(FILES):                  # RAM-only: the handover writes them down
        data[f"kv/f{i}"] = content(f"r{i}", SIZE + i)
        (m.path / f"kv/f{i}").write_bytes(data[f"kv/f{i}"])
    want = {k: hashlib.sha256(v).hexdigest() for k, v in data.items()}
    progress, stop = tmp_path / "progress", tmp_path / "stop"
    proc = subprocess.Popen([sys.executable, "-c", LOOPER, str(m.path), json.dumps(want), str(progress),
                             str(stop)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_rounds(progress, 3, proc)
        old = m.pid
        res = kvfs_cli("restart", m.path)
        assert res.returncode == 0, res.stderr + m.log_tail()
        assert "restarted" in res.stdout
        st = _track(m)
        assert m.pid != old and not pid_alive(old)
        before = int(progress.read_text())
        _wait_rounds(progress, before + 3, proc)
    finally:
        stop.touch()
        out, err = proc.communicate(timeout=EXIT_TIMEOUT)
    seen = json.loads(out)
    assert seen["errors"] == {} and seen["wrong"] == 0, seen
    sup = st["supervisor"]
    assert sup["epoch"] == 2 and sup["history"][-1]["cause"] == "restart", sup
    for name, body in data.items():
        assert read(m.path / name) == body
    res = kvfs_cli("stat", m.path)
    assert res.returncode == 0 and "1 restart(s); last: restart" in res.stdout, res.stdout


def test_a_request_the_dead_daemon_had_read_is_sent_again_and_answered(kvfs_mount):
    """A read of ``.kvfs/events`` waits in the daemon (up to a second for an event): killed
    then, the daemon took the request with it. The kernel sends it again to the next daemon
    (FUSE_NOTIFY_RESEND), which answers EIO (its handle died with the old daemon) -- without
    the resend the reader would wait forever, without the supervisor it would get ENOTCONN."""
    m = kvfs_mount(supervise=True)
    _track(m)
    code = ("import os, sys\n"
            "fd = os.open(sys.argv[1], os.O_RDONLY)\n"
            "print('open', flush=True)\n"
            "try:\n"
            "    while True:\n"
            "        os.read(fd, 4096)\n"
            "except OSError as e:\n"
            "    print(e.errno, flush=True)\n")
    reader = subprocess.Popen([sys.executable, "-c", code, str(m.path / ".kvfs" / "events")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdout.readline().strip() == "open"
        _kill_daemon(m)
        out, _ = reader.communicate(timeout=EXIT_TIMEOUT)
    finally:
        if reader.poll() is None:
            reader.kill()
    assert out.strip() == str(errno.EIO), out
    assert m.stats()["transport"]["resend"] == "sent"


def test_a_crash_loop_backs_off_then_detaches_the_mount(kvfs_mount):
    from kvfs.supervisor import CRASH_LIMIT
    m = kvfs_mount(supervise=True)
    st = _track(m)
    sup = int(st["supervisor"]["pid"])
    killed = {m.pid}
    os.kill(m.pid, signal.SIGKILL)

    def children() -> set[int]:
        try:
            with open(f"/proc/{sup}/task/{sup}/children") as f:
                return {int(p) for p in f.read().split()}
        except OSError:
            return set()

    def kill_the_next():               # every new daemon (and standby) dies at once (never by stats: it blocks)
        if not pid_alive(sup):
            return True
        for pid in children() - killed:
            killed.add(pid)
            m._pids.add(pid)
            os.kill(pid, signal.SIGKILL)
        return False
    wait_for(kill_the_next, EXIT_TIMEOUT, "the supervisor to give up")
    assert not os.path.ismount(m.path)
    text = (m.state / "kvfs.log").read_text()
    assert "crash loop" in text and "giving up" in text
    # the serving daemons' deaths (a standby killed before it served is not one)
    assert text.count("died (signal 9 (SIGKILL))") == CRASH_LIMIT + 1, text


def test_the_pyfuse3_transport_is_not_supervised_and_says_so(kvfs_mount, kvfs_cli):
    m = kvfs_mount(supervise=True, transport="pyfuse3")
    st = m.stats()
    assert st["transport"]["name"] == "pyfuse3"
    assert st["supervisor"]["state"].startswith("off (chosen: transport = pyfuse3)"), st["supervisor"]
    assert "no supervisor (chosen: transport = pyfuse3)" in (m.state / "kvfs.log").read_text()
    assert not (m.state / "supervisor.sock").exists()
    res = kvfs_cli("restart", m.path)
    assert res.returncode != 0 and "has no supervisor" in res.stderr


def test_sigterm_to_a_supervised_daemon_unmounts_and_both_exit(kvfs_mount):
    m = kvfs_mount(supervise=True)
    st = _track(m)
    (m.path / "kept").write_bytes(b"x" * 1000)         # RAM-only: the write-down keeps it
    sup = int(st["supervisor"]["pid"])
    os.kill(m.pid, signal.SIGTERM)
    wait_for(lambda: not pid_alive(m.pid) and not pid_alive(sup), EXIT_TIMEOUT, "daemon and supervisor to exit")
    assert not os.path.ismount(m.path)
    assert "wrote 1 RAM-only objects down" in (m.state / "kvfs.log").read_text()


def test_kvfs_upgrade_reexecs_the_supervisor_under_load_then_a_kill_still_restarts(kvfs_mount, kvfs_cli,
                                                                                   tmp_path):
    import hashlib
    m = kvfs_mount(supervise=True)
    sup = int(_track(m)["supervisor"]["pid"])
    data = _durable_files(m)
    assert int(_track(m)["supervisor"]["pid"]) != sup       # the remount made a new supervisor
    sup = int(m.stats()["supervisor"]["pid"])
    want = {k: hashlib.sha256(v).hexdigest() for k, v in data.items()}
    progress, stop = tmp_path / "progress", tmp_path / "stop"
    proc = subprocess.Popen([sys.executable, "-c", LOOPER, str(m.path), json.dumps(want), str(progress),
                             str(stop)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_rounds(progress, 3, proc)
        res = kvfs_cli("upgrade", m.path)
        assert res.returncode == 0, res.stderr + m.log_tail()
        st = _track(m)
        assert int(st["supervisor"]["pid"]) == sup                  # the same process, a new image
        assert st["supervisor"]["epoch"] == 2
        _wait_rounds(progress, int(progress.read_text()) + 3, proc)
        _kill_daemon(m)                                             # the new image supervises
        _wait_rounds(progress, int(progress.read_text()) + 3, proc)
    finally:
        stop.touch()
        out, err = proc.communicate(timeout=EXIT_TIMEOUT)
    seen = json.loads(out)
    assert seen["errors"] == {} and seen["wrong"] == 0, seen
    st = m.stats()
    assert st["supervisor"]["epoch"] == 3 and st["supervisor"]["history"][-1]["cause"].startswith("signal 9")
    assert "resumed after re-exec" in (m.state / "kvfs.log").read_text()
    res = kvfs_cli("umount", m.path)
    assert res.returncode == 0, res.stderr
    wait_for(lambda: not pid_alive(sup), EXIT_TIMEOUT, "the re-executed supervisor to exit")


def test_a_supervised_mount_between_two_daemons_is_not_taken_for_dead(kvfs_mount):
    """``kvfs umount`` detaches a mount whose daemon is dead (issue 40): under a supervisor
    the daemon's death is a pause, so the mount counts as dead only with its supervisor. The
    supervisor is stopped so that the window between two daemons stays open for the check."""
    from kvfs.cli.mounting import dead_daemon
    m = kvfs_mount(supervise=True)
    st = _track(m)
    sup, old = int(st["supervisor"]["pid"]), m.pid
    os.kill(sup, signal.SIGSTOP)
    try:
        os.kill(old, signal.SIGKILL)
        wait_for(lambda: not pid_alive(old), EXIT_TIMEOUT, f"daemon {old} to die")
        assert dead_daemon(str(m.path)) is None
    finally:
        os.kill(sup, signal.SIGCONT)
    wait_for(lambda: int(m.stats()["pid"]) != old, EXIT_TIMEOUT, "a new daemon to serve")
    _track(m)
