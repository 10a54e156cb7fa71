"""The supervisor: the process that holds a mount's ``/dev/fuse`` session for the mount's life
and starts its daemon again when the daemon dies (issue 41).

Started by ``kvfs mount`` (kvfs/cli/mounting.py) as ``python -m kvfs.supervisor
--config-json JSON --ready-fd N`` where kvfs's own FUSE transport runs (root, Linux 5.17+),
in place of the daemon. It imports no store code: it starts ``python -m kvfs.daemon`` with
``--attach <state>/supervisor.sock --epoch G``, and the daemon, once its store is open, connects
to that socket and asks for the session. The first time, the supervisor mounts (mount(2) on a
``/dev/fuse`` descriptor it opens and keeps; the daemon answers INIT and sends back what INIT
agreed on); each time, it hands the daemon the descriptor (SCM_RIGHTS) with that state, the
daemon's epoch (its number in the mount's life, put into every file handle it gives the kernel)
and the restart history. Because the supervisor's descriptor is the *same open file* as the
daemon's, a killed daemon's exit releases nothing: the requests it had read stay on that file's
processing list, those not yet read stay queued, and callers wait. The next daemon recovers the
store (the crash start), asks the kernel to send again what the dead one had read
(FUSE_NOTIFY_RESEND, kvfs/fs/session.py) and serves.

The socket is ``0600`` in the private state directory and every peer is checked with
SO_PEERCRED: only root may talk to it, and the session goes only to the daemon this supervisor
started last, once (a second daemon is refused). Requests on it are one JSON line each:
``attach`` (the daemon), ``agreed`` and ``served`` (the daemon, on its connection),
``restart`` (``kvfs restart``: the daemon finishes what it read, writes down and exits with
:data:`HANDOVER`; the next one takes over), ``reexec`` (``kvfs upgrade``: this program runs
again from disk, keeping its descriptors and children, kvfs/reexec.py), ``status``.
A standby daemon, its modules loaded, waits to be the next (``--standby``): a restart then
costs the store's start, not the interpreter's.

When the daemon exits: if the connection is gone (unmounted) the supervisor exits with the
daemon's status; :data:`HANDOVER` starts the next at once; any other end is a crash: the next
is started at once the first time, then after a back-off that doubles while daemons keep dying
within :data:`STABLE_S` of their start, and after :data:`CRASH_LIMIT` such deaths in a row the
mount is detached (its callers then get ENOTCONN, as without a supervisor) with the reason
logged. SIGTERM/SIGINT detach the mount (the daemon then writes down and exits, as at
``kvfs umount``). The supervisor sets its own ``oom_score_adj`` to -1000 and its daemon's back
to 0: the OOM killer takes the daemon (whose RAM tier it counts), never the session.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from kvfs import reexec
from kvfs.handover import HANDOVER, HISTORY, SOCKET_NAME, peer_credentials, recv_line, send

log = logging.getLogger("kvfs.supervisor")

LOCK_NAME = "supervisor.lock"
# a daemon that lived this long ends a crash loop (KVFS_RESTART_STABLE_S: for a benchmark
# that kills daemons on purpose every second, benchmarks/restart_pause.py)
STABLE_S = float(os.environ.get("KVFS_RESTART_STABLE_S", "30"))
CRASH_LIMIT = 5         # deaths in a row (each within STABLE_S of its start) before giving up
BACKOFF_S = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0)
# a daemon started ahead, its modules loaded, waits to replace the serving one (~0.4 s of a
# restart's pause here; ~60 MiB of memory): KVFS_RESTART_STANDBY=0 sets it off
STANDBY = os.environ.get("KVFS_RESTART_STANDBY", "1").strip().lower() not in ("0", "false", "no", "off")
PEER_TIMEOUT = 5.0      # seconds a peer has to send its request
LOCK_WAIT_S = 5.0       # how long a new supervisor waits for the state's last one to exit
STANDBY_DELAY_S = 2.0   # a standby starts this long after its daemon is ready (not in its way)


# ---- the supervisor ---------------------------------------------------------------------------
class Proc:
    """A child process: one started here (a ``Popen``, kept referenced so that nothing else
    reaps it) or one inherited across a re-exec of the supervisor (its pid: still our child)."""

    def __init__(self, pid: int, popen: subprocess.Popen | None = None, stdin_fd: int = -1):
        self.pid, self.popen = pid, popen
        self.returncode: int | None = None
        if popen is not None:
            self.stdin = popen.stdin
        else:
            self.stdin = os.fdopen(stdin_fd, "wb", buffering=0) if stdin_fd >= 0 else None

    def poll(self) -> int | None:
        if self.popen is not None:
            return self.popen.poll()
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                self.returncode = 255
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.popen is not None:
            return self.popen.wait(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            if deadline is None:
                try:
                    _, status = os.waitpid(self.pid, 0)
                    self.returncode = os.waitstatus_to_exitcode(status)
                except ChildProcessError:
                    self.returncode = 255
            else:
                time.sleep(0.01)
        return self.returncode

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)


class Supervisor:
    def __init__(self, config_json: str, ready_fd: int | None):
        cfg = json.loads(config_json)
        self.config_json = config_json
        self.mountpoint = os.path.abspath(cfg["mountpoint"])
        self.state = Path(cfg["state"])
        self.sock_path = str(self.state / SOCKET_NAME)
        self.ready_fd = ready_fd
        self.fd = -1                    # the session's /dev/fuse descriptor, once mounted
        self.agreed: dict | None = None
        self.backing: dict[str, dict] = {}   # backing id -> the registration (ino, oid, tier)
        self.epoch = 0
        self.child: Proc | None = None
        self.standby: tuple[Proc, int] | None = None    # started ahead, waiting
        self.reexec_due = False         # a re-exec was asked for (kvfs upgrade)
        self.image = time.time()        # when this program image started (a re-exec changes it)
        self.standby_at: float | None = None     # when to start the next standby
        self.child_pidfd = -1
        self.child_ready = -1           # read end of the child's ready pipe
        self.started_at = 0.0
        self.attached: socket.socket | None = None
        self.attached_buf = bytearray()
        self.history: list[dict] = []
        self.crashes = 0                # deaths in a row, each soon after its start
        self.restart_at: float | None = None     # when the next daemon is due (back-off)
        self.cause: str | None = None   # why the running daemon was started (None: the first)
        self.died_at: float | None = None
        self.ended = False              # the connection is gone: exit with the daemon
        self.exit_status = 0

    # -- set-up ------------------------------------------------------------------------------
    def listen(self) -> None:
        self.lock = os.open(self.state / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:                 # the supervisor of an unmount just made may be on its way out
            try:
                fcntl.flock(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"another kvfs supervisor serves the state directory {self.state}") from None
                time.sleep(0.02)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.sock_path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        old = os.umask(0o177)
        try:
            self.sock.bind(self.sock_path)
        finally:
            os.umask(old)
        os.chmod(self.sock_path, 0o600)
        self.sock.listen(8)
        self.sock.setblocking(False)

    def _start(self, standby: bool) -> tuple[Proc, int]:
        """A daemon process and the read end of its ready pipe; a standby imports kvfs and
        waits for its epoch on its stdin (see :meth:`spawn`)."""
        rfd, wfd = os.pipe2(os.O_CLOEXEC)
        argv = [sys.executable, "-m", "kvfs.daemon", "--config-json", self.config_json,
                "--ready-fd", str(wfd), "--attach", self.sock_path]
        argv += ["--standby"] if standby else ["--epoch", str(self.epoch)]
        popen = subprocess.Popen(argv, pass_fds=(wfd,), cwd="/", preexec_fn=_daemon_oom_score,
                                 stdin=subprocess.PIPE if standby else subprocess.DEVNULL)
        os.close(wfd)
        return Proc(popen.pid, popen), rfd

    def spawn(self) -> None:
        """Start the next daemon (epoch + 1): the standby started ahead when there is one (its
        Python and kvfs's modules already loaded: a restart then costs the store's start,
        not the interpreter's), else a new process."""
        self.epoch += 1
        proc, rfd = self.standby or (None, -1)
        self.standby = None
        if proc is not None and proc.poll() is None:
            try:
                proc.stdin.write(f"{self.epoch}\n".encode())
                proc.stdin.close()
            except OSError:
                proc.kill()
                proc.wait()
                os.close(rfd)
                proc = None
        elif proc is not None:
            os.close(rfd)
            proc = None
        if proc is None:
            proc, rfd = self._start(standby=False)
        self.child = proc
        self.child_pidfd = os.pidfd_open(self.child.pid)
        self.child_ready = rfd
        self.started_at = time.monotonic()
        self.restart_at = None
        log.info("supervisor %d: started daemon %d (epoch %d%s)", os.getpid(), self.child.pid,
                 self.epoch, f", after {self.cause}" if self.cause else "")

    def start_standby(self) -> None:
        if self.standby is None and STANDBY and not self.ended:
            self.standby = self._start(standby=True)
            log.info("supervisor: standby daemon %d started", self.standby[0].pid)

    def drop_standby(self) -> None:
        if self.standby is not None:
            proc, rfd = self.standby
            self.standby = None
            with contextlib.suppress(OSError):
                proc.stdin.close()          # EOF: it exits
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            os.close(rfd)

    # -- requests on the socket --------------------------------------------------------------
    def accept(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except BlockingIOError:
            return
        conn.setblocking(True)
        conn.settimeout(PEER_TIMEOUT)
        keep = False
        try:
            pid, uid, _ = peer_credentials(conn)
            if uid != 0:
                log.warning("supervisor: refused a peer that is not root (pid %d, uid %d)", pid, uid)
                send(conn, {"ok": False, "why": "refused: the peer is not root"})
                return
            req = recv_line(conn, bytearray())
            if req is None:
                return
            op = req.get("op")
            if op == "attach":
                keep = self.on_attach(conn, pid, req)
            elif op == "restart":
                send(conn, self.on_restart())
            elif op == "status":
                send(conn, {"ok": True, **self.status()})
            elif op == "reexec":
                self.reexec_due = True
                send(conn, {"ok": True, "image": self.image})
            else:
                send(conn, {"ok": False, "why": f"unknown request {op!r}"})
        except (OSError, ValueError) as e:
            log.warning("supervisor: a request failed: %s", e)
        finally:
            if not keep:
                conn.close()

    def on_attach(self, conn: socket.socket, pid: int, req: dict) -> bool:
        child = self.child.pid if self.child is not None and self.child.poll() is None else None
        if pid != child:
            log.warning("supervisor: refused a daemon it did not start (pid %d; its daemon is %s)", pid, child)
            send(conn, {"ok": False, "why": f"refused: pid {pid} is not the daemon this supervisor started"})
            return False
        if self.attached is not None:
            log.warning("supervisor: refused a second attach by daemon %d", pid)
            send(conn, {"ok": False, "why": "refused: a daemon is attached already"})
            return False
        if self.fd < 0:
            from kvfs.fs.mountdev import mount_device
            try:
                self.fd = mount_device(self.mountpoint, set(req.get("options") or ()))
            except OSError as e:
                send(conn, {"ok": False, "why": str(e)})
                return False
            log.info("supervisor %d: mounted %s", os.getpid(), self.mountpoint)
        send(conn, {"ok": True, "epoch": self.epoch, "agreed": self.agreed, "supervisor": os.getpid(),
                     "backing": list(self.backing.values()),
                     "died_at": self.died_at, "cause": self.cause, "history": self.history[-HISTORY:]},
              fd=self.fd)
        conn.settimeout(None)
        conn.setblocking(False)
        self.attached, self.attached_buf = conn, bytearray()
        return True

    def on_daemon_note(self) -> bool:
        """Read the attached daemon's notes; False when none is waiting."""
        conn = self.attached
        try:
            chunk = conn.recv(1 << 16)
        except BlockingIOError:
            return False
        except OSError:
            chunk = b""
        if not chunk:
            conn.close()
            self.attached = None
            return False
        self.attached_buf += chunk
        while b"\n" in self.attached_buf:
            line, _, rest = bytes(self.attached_buf).partition(b"\n")
            self.attached_buf[:] = rest
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if msg.get("op") == "agreed":
                self.agreed = msg.get("agreed")
            elif msg.get("op") == "backing":        # the daemon's passthrough registrations
                self.backing[str(msg.get("id"))] = {k: msg.get(k) for k in ("id", "ino", "oid", "tier")}
            elif msg.get("op") == "unbacking":
                self.backing.pop(str(msg.get("id")), None)
            elif msg.get("op") == "served" and self.history:
                self.history[-1].update({k: msg[k] for k in ("pause_s", "ready_s", "resend") if k in msg})
                log.info("supervisor: daemon %s served its first request %.3fs after its predecessor's end",
                         self.child.pid if self.child else "?", msg.get("pause_s") or -1)
        return True

    def on_restart(self) -> dict:
        if self.child is None or self.child.poll() is not None or self.attached is None:
            return {"ok": False, "why": "no daemon is serving now (a restart is under way)"}
        log.info("supervisor: restart asked for: daemon %d hands over", self.child.pid)
        self.cause = "restart"
        os.kill(self.child.pid, signal.SIGUSR2)
        return {"ok": True, "pid": self.child.pid}

    def status(self) -> dict:
        return {"supervisor": os.getpid(), "pid": self.child.pid if self.child else None,
                "epoch": self.epoch, "history": self.history[-HISTORY:], "image": self.image}

    # -- the daemon's end --------------------------------------------------------------------
    def connected(self) -> bool:
        if self.fd < 0:
            return False
        p = select.poll()
        p.register(self.fd, 0)
        return not any(ev & (select.POLLERR | select.POLLHUP | select.POLLNVAL) for _, ev in p.poll(0))

    def on_ready_line(self) -> None:
        try:
            data = os.read(self.child_ready, 4096)
        except OSError:
            data = b""
        os.close(self.child_ready)
        self.child_ready = -1
        line = data.split(b"\n", 1)[0].decode(errors="replace").strip()
        if self.ready_fd is not None and (line.startswith("READY") or line.startswith("ERROR") or not line):
            if line.startswith("READY"):
                line = f"READY {self.child.pid} supervisor {os.getpid()}"
            elif not line:
                line = "ERROR the daemon exited before the mount was ready"
            with contextlib.suppress(OSError):
                os.write(self.ready_fd, (line + "\n").encode())
            os.close(self.ready_fd)
            self.ready_fd = None
            if not line.startswith("READY"):
                self.ended = True       # the first daemon failed: no mount to keep
                if self.fd >= 0:
                    from kvfs.fs.mountdev import detach
                    detach(self.mountpoint)
                    self.close_session()
        elif line.startswith("READY"):
            log.info("supervisor: daemon %d ready (epoch %d)", self.child.pid, self.epoch)
        if line.startswith("READY"):
            # the first daemon's standby at once; after a restart, once the new daemon had
            # the machine to itself for its first requests
            self.standby_at = time.monotonic() + (STANDBY_DELAY_S if self.epoch > 1 else 0.0)

    def on_child_exit(self) -> None:
        rc = self.child.wait()
        os.close(self.child_pidfd)
        self.child_pidfd = -1
        if self.child_ready >= 0:
            self.on_ready_line()
        # every note the dead daemon sent is in the socket still: its last backing closures
        # must not be lost (the next daemon would take a closed id over)
        while self.attached is not None and self.on_daemon_note():
            pass
        if self.attached is not None:
            self.attached.close()
            self.attached = None
        now = time.monotonic()
        cause = f"signal {-rc} ({signal.Signals(-rc).name})" if rc < 0 else f"exit {rc}"
        if self.ended or not self.connected():
            log.info("supervisor: daemon %d ended (%s) and the mount is gone: exiting", self.child.pid, cause)
            self.ended = True
            self.exit_status = 0 if rc in (0, HANDOVER) else 1
            self.child = None
            return
        self.died_at = now
        if rc == HANDOVER:
            self.crashes = 0
            self.cause = "restart"
        else:
            lived = now - self.started_at
            self.crashes = self.crashes + 1 if lived < STABLE_S else 1
            self.cause = cause
            log.error("supervisor: daemon %d died (%s) after %.1fs; the mount stays, a new daemon serves it",
                      self.child.pid, cause, lived)
            if self.crashes > CRASH_LIMIT:
                self.give_up(f"{self.crashes} daemons in a row died within {STABLE_S:.0f}s of their start, "
                             f"the last by {cause}")
                self.child = None
                return
        self.history.append({"cause": self.cause, "at": time.time(), "pid": self.child.pid})
        delay = BACKOFF_S[min(self.crashes - 1, len(BACKOFF_S) - 1)] if self.crashes else 0.0
        if delay:
            log.warning("supervisor: crash loop (%d in a row): next daemon in %.2fs", self.crashes, delay)
        self.restart_at = now + delay
        self.child = None

    def give_up(self, why: str) -> None:
        log.error("supervisor: giving up: %s; detaching %s (its users get ENOTCONN until it is "
                  "mounted again)", why, self.mountpoint)
        from kvfs.fs.mountdev import detach
        detach(self.mountpoint)
        self.close_session()
        self.ended = True
        self.exit_status = 1

    def close_session(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def on_signal(self, sig: int) -> None:
        log.info("supervisor: signal %d: unmounting %s", sig, self.mountpoint)
        from kvfs.fs.mountdev import detach
        detach(self.mountpoint)
        if self.child is None:      # between daemons: no one will write down; end here
            self.close_session()
            self.ended = True

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> int:
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wake_w)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda *_: None)
        if self.child is None and not self.ended:
            self.spawn()
        while True:
            if self.ended and self.child is None:
                break
            if self.reexec_due:
                reexec.exec_again(self)     # returns only when it could not
            if self.fd >= 0 and self.child is None and not self.connected():
                self.ended = True
                continue
            if self.child is None and self.restart_at is not None and time.monotonic() >= self.restart_at:
                self.spawn()
            if self.standby_at is not None and time.monotonic() >= self.standby_at:
                self.standby_at = None
                if self.child is not None:
                    self.start_standby()
            p = select.poll()
            watched = {wake_r: "signal", self.sock.fileno(): "socket"}
            if self.child_pidfd >= 0:
                watched[self.child_pidfd] = "exit"
            if self.child_ready >= 0:
                watched[self.child_ready] = "ready"
            if self.attached is not None:
                watched[self.attached.fileno()] = "note"
            for fd in watched:
                p.register(fd, select.POLLIN)
            if self.fd >= 0 and self.child is None:
                p.register(self.fd, 0)          # POLLERR: the connection ended between daemons
            due = [t for t in (self.restart_at if self.child is None else None, self.standby_at) if t is not None]
            timeout = max(0, int((min(due) - time.monotonic()) * 1000) + 1) if due else None
            for fd, _ in p.poll(timeout):
                what = watched.get(fd)
                if what == "signal":
                    with contextlib.suppress(OSError):
                        for sig in os.read(wake_r, 64):
                            self.on_signal(sig)
                elif what == "socket":
                    self.accept()
                elif what == "ready" and self.child_ready >= 0:
                    self.on_ready_line()
                elif what == "note" and self.attached is not None:
                    self.on_daemon_note()
                elif what == "exit" and self.child_pidfd >= 0:
                    self.on_child_exit()
        self.drop_standby()
        self.close_session()
        with contextlib.suppress(OSError):
            os.unlink(self.sock_path)
        log.info("supervisor %d: exiting (%d)", os.getpid(), self.exit_status)
        return self.exit_status


def _daemon_oom_score() -> None:
    """In the daemon's child before exec: the OOM killer's default score again (the supervisor
    made its own -1000, which a child inherits)."""
    with contextlib.suppress(OSError):
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("0")


def _protect_from_oom() -> None:
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("-1000")
    except OSError as e:
        log.warning("supervisor: could not set its oom_score_adj: %s", e)


def main() -> int:
    p = argparse.ArgumentParser(prog="kvfs-supervisor")
    p.add_argument("--config-json")
    p.add_argument("--ready-fd", type=int)
    p.add_argument("--resume", type=int, metavar="FD", help="(a re-exec) the state handed over")
    a = p.parse_args()
    os.umask(0o077)
    if a.resume is not None:
        os.lseek(a.resume, 0, os.SEEK_SET)
        a.config_json = json.loads(os.pread(a.resume, 1 << 24, 0))["config_json"]
    cfg = json.loads(a.config_json)
    logging.basicConfig(level=logging.DEBUG if cfg.get("debug") else logging.INFO,
                        handlers=[logging.FileHandler(Path(cfg["state"]) / "kvfs.log")],
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if a.resume is not None:
        return reexec.restore(Supervisor(a.config_json, None), a.resume, Proc).run()
    sup = Supervisor(a.config_json, a.ready_fd)
    try:
        sup.listen()
    except (OSError, RuntimeError) as e:
        if a.ready_fd is not None:
            with contextlib.suppress(OSError):
                os.write(a.ready_fd, f"ERROR {e}\n".encode())
        return 2
    _protect_from_oom()
    return sup.run()


if __name__ == "__main__":
    sys.exit(main())
