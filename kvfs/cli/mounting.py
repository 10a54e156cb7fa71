"""``kvfs mount`` and ``kvfs umount``: pre-checks, spawning the daemon, waiting for it."""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

from kvfs.cli.common import KVFS_FSTYPES, STATS_NAME, CLIError, fail, mount_fstype, pid_alive, read_stats, stderr, wait_until
from kvfs.config import Config
from kvfs.errors import ConfigError
from kvfs.protocol import UNMOUNT_REPORT, UNMOUNT_REPORT_KEY

log = logging.getLogger(__name__)

READY_TIMEOUT = 120.0      # seconds to wait for the daemon's READY line
LAZY_STATS_TIMEOUT = 2.0   # seconds kvfs umount --lazy waits for the daemon's pid before detaching


def build_config(config_file: str | None, mountpoint: str | None = None, **flags) -> Config:
    """Defaults, then ``config_file``, then the flags that were given; paths made absolute."""
    try:
        cfg = Config.load(config_file, **flags)
    except ConfigError as e:
        raise fail(str(e)) from None
    except TypeError as e:           # a TOML value of the wrong shape
        raise fail(f"bad configuration: {e}") from None
    if mountpoint is not None:
        cfg = dataclasses.replace(cfg, mountpoint=os.path.abspath(mountpoint))
    return dataclasses.replace(cfg, nvme=str(cfg.nvme_dir), state=str(cfg.state_dir))


def _probe_writable(d: Path, what: str) -> None:
    """Create ``d`` (with parents) and prove a file can be written in it."""
    try:
        d.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise fail(f"{what} {d} exists and is not a directory") from None
    except OSError as e:
        raise fail(f"cannot create {what} {d}: {e.strerror}") from None
    if not d.is_dir():
        raise fail(f"{what} {d} is not a directory")
    try:
        fd, name = tempfile.mkstemp(prefix=".kvfs-probe-", dir=d)
        os.close(fd)
        os.unlink(name)
    except OSError as e:
        raise fail(f"{what} {d} is not writable: {e.strerror}") from None


def precheck(cfg: Config) -> None:
    """Everything that can be checked before a daemon is spawned, as one-line errors."""
    mp = Path(cfg.mountpoint)
    if not mp.exists():
        raise fail(f"mountpoint does not exist: {mp}")
    if not mp.is_dir():
        raise fail(f"mountpoint is not a directory: {mp}")
    if os.path.ismount(mp):
        raise fail(f"already mounted: {mp}")
    if not os.path.exists("/dev/fuse"):
        raise fail("/dev/fuse is missing: load the fuse module (modprobe fuse) or install fuse3")
    from kvfs.fs.loop import binding_problem
    problem = binding_problem()
    if problem:
        raise fail(problem)
    try:
        cfg.validate()
    except ConfigError as e:
        raise fail(str(e)) from None
    nvme, state = cfg.nvme_dir, cfg.state_dir
    if nvme == mp or mp in nvme.parents or state == mp or mp in state.parents:
        raise fail(f"the NVMe and state directories must lie outside the mountpoint {mp}")
    _probe_writable(nvme, "NVMe directory")
    _probe_writable(state, "state directory")


def _read_ready(rfd: int, proc: subprocess.Popen, timeout: float) -> str:
    """Read the daemon's first line from the ready pipe (EOF or timeout: '')."""
    buf = b""
    deadline = time.monotonic() + timeout
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            return ""
        ready, _, _ = select.select([rfd], [], [], min(left, 0.5))
        if not ready:
            continue
        chunk = os.read(rfd, 4096)
        if not chunk:
            break
        buf += chunk
    return buf.split(b"\n", 1)[0].decode(errors="replace").strip()


def _log_hint(cfg: Config) -> str:
    return f" (see {Path(cfg.state_dir) / 'kvfs.log'})"


def spawn_daemon(cfg: Config, timeout: float = READY_TIMEOUT) -> int:
    """Start the daemon detached; return its pid once it says READY."""
    rfd, wfd = os.pipe()
    log_path = Path(cfg.state_dir) / "kvfs.log"
    argv = [sys.executable, "-m", "kvfs.supervisor" if supervised(cfg) else "kvfs.daemon",
            "--config-json", json.dumps(dataclasses.asdict(cfg)), "--ready-fd", str(wfd)]
    env = dict(os.environ)
    # the daemon runs with cwd=/ so the checkout must stay importable
    pkg_root = str(Path(__file__).resolve().parent.parent.parent)
    env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    with open(log_path, "ab") as errlog:
        proc = subprocess.Popen(
            argv, pass_fds=(wfd,), start_new_session=True, cwd="/", env=env,
            stdin=subprocess.DEVNULL, stdout=errlog, stderr=errlog)
    os.close(wfd)
    try:
        line = _read_ready(rfd, proc, timeout)
    finally:
        os.close(rfd)
    if line.startswith("READY"):
        parts = line.split()
        pid = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else proc.pid
        if not wait_until(lambda: os.path.ismount(cfg.mountpoint), 10):
            raise fail(f"daemon said READY but {cfg.mountpoint} is not mounted" + _log_hint(cfg))
        return pid
    if line.startswith("ERROR"):
        msg = line[len("ERROR"):].strip() or "the daemon failed"
        _reap(proc)
        raise fail(msg)
    if not line and proc.poll() is None:
        proc.kill()
        _reap(proc)
        raise fail(f"the daemon did not become ready within {timeout:.0f}s" + _log_hint(cfg))
    rc = _reap(proc)
    detail = f"daemon exited with status {rc}" if rc is not None else "daemon closed its ready pipe"
    raise fail(f"{detail} before the mount was ready" + _log_hint(cfg))


def supervised(cfg: Config) -> bool:
    """Whether ``kvfs mount`` starts the supervisor (kvfs/supervisor.py), which starts the
    daemon: ``supervise`` on and kvfs's own transport able to run (otherwise the daemon is
    started alone, as before, and says why in its log)."""
    if not cfg.supervise or cfg.foreground or cfg.transport == "pyfuse3":
        return False
    from kvfs.fs.session import unavailable
    return unavailable() is None


def _reap(proc: subprocess.Popen) -> int | None:
    try:
        return proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        return None


def size_option(name: str, help: str):
    return click.option(name, metavar="SIZE", default=None, help=help)


@click.command("mount")
@click.argument("mountpoint", type=click.Path(file_okay=True, dir_okay=True))
@size_option("--ram", "RAM tier budget: 64MiB, 10GiB, 50% of memory (default 10%).")
@click.option("--nvme", metavar="DIR", default=None,
              help="Local NVMe tier directory (default ~/.cache/kvfs/nvme).")
@size_option("--nvme-size", "NVMe tier budget: bytes or % of its filesystem (default 50%).")
@click.option("--state", metavar="DIR", default=None,
              help="Index (LMDB) and log directory (default <nvme>/state).")
@click.option("--config", "config_file", metavar="FILE", default=None,
              help="TOML config file; flags override it.")
@click.option("--allow-other", is_flag=True, default=None,
              help="Let other users access the mount (adds default_permissions).")
@click.option("--remote", metavar="URL", default=None,
              help="Remote NVMe/TCP tier: nvme-tcp://host:port/nqn (or a block device/file).")
@size_option("--remote-size", "Remote tier budget (default 100% of the volume).")
@click.option("--format-remote", "remote_format", is_flag=True, default=None,
              help="Format the remote volume (destroys what is on it).")
@click.option("--share", is_flag=True, default=None,
              help="Share the remote volume with other kvfs nodes (format 2; see docs/scale-out.md).")
@click.option("--share-max-nodes", type=int, default=None,
              help="Node slots when a shared volume is formatted (default 8).")
@click.option("--share-lease", type=float, default=None, metavar="SECONDS",
              help="Heartbeat lease on a shared volume (default 10): a node silent for lease + grace "
                   "is dead and its region may be taken over.")
@click.option("--node-id", metavar="ID", default=None,
              help="This node's id on a shared volume (default: the instance id).")
@click.option("--volatile-ram", is_flag=True, default=None,
              help="On clean unmount, do not write RAM-only objects down to NVMe.")
@click.option("--metrics", metavar="HOST:PORT", default=None,
              help="Serve Prometheus metrics at http://HOST:PORT/metrics (default off; "
                   "PORT alone listens on 127.0.0.1).")
@click.option("--transport", type=click.Choice(["auto", "kernel", "pyfuse3"]), default=None,
              help="FUSE transport: kvfs's own (kernel: root, FUSE passthrough), pyfuse3, or auto "
                   "(default: kernel where it can run).")
@click.option("--passthrough/--no-passthrough", default=None,
              help="Let the kernel read sealed blocks from their tier files (FUSE passthrough; "
                   "default on where the kernel offers it; KVFS_PASSTHROUGH=0 sets it off).")
@click.option("--supervise/--no-supervise", default=None,
              help="A supervisor holds the mount and starts the daemon again when it dies: a crash "
                   "or `kvfs restart` is a pause, not ENOTCONN (kvfs's own transport; "
                   "KVFS_SUPERVISE=1 sets the default on).")
@click.option("--debug", is_flag=True, default=None, help="Debug logging in the daemon.")
@click.option("--foreground", "-f", is_flag=True, default=False,
              help="Stay attached: run the daemon in this process until unmounted.")
@click.option("--timeout", type=float, default=READY_TIMEOUT, show_default=True,
              help="Seconds to wait for the daemon to become ready.")
def mount_cmd(mountpoint, config_file, foreground, timeout, **flags):
    """Mount kvfs at MOUNTPOINT; returns once the mount is ready."""
    cfg = dataclasses.replace(build_config(config_file, mountpoint, **flags), foreground=bool(foreground))
    precheck(cfg)
    if foreground:
        _run_foreground(cfg)
        return
    pid = spawn_daemon(cfg, timeout)
    log.info("kvfs mounted at %s (daemon pid %d)", cfg.mountpoint, pid)
    click.echo(f"kvfs mounted at {cfg.mountpoint} (pid {pid}, nvme {cfg.nvme}, state {cfg.state})")
    if cfg.metrics:
        try:
            where = read_stats(cfg.mountpoint).get("metrics")
        except CLIError:
            where = None
        click.echo(f"metrics at http://{where or cfg.metrics}/metrics")


def _run_foreground(cfg: Config) -> None:
    try:
        from kvfs import daemon
    except ImportError as e:
        raise fail(f"the kvfs daemon is not available: {e}") from None
    try:
        rc = daemon.main(cfg, ready_fd=None)
    except ConfigError as e:
        raise fail(str(e)) from None
    except KeyboardInterrupt:
        rc = 0
    sys.exit(int(rc or 0))


@click.command("umount")
@click.argument("mountpoint")     # a plain string: click.Path would stat() a stuck mount
@click.option("--timeout", type=float, default=600.0, show_default=True,
              help="Seconds to wait for the daemon to finish flushing and exit.")
@click.option("--lazy", "-z", is_flag=True, help="Lazy unmount (fusermount3 -z), e.g. a dead daemon.")
def umount_cmd(mountpoint, timeout, lazy):
    """Unmount kvfs at MOUNTPOINT and wait until the daemon has flushed and exited."""
    mp = os.path.abspath(mountpoint)
    # the kernel's mount table, not stat(): a dead daemon's mount answers ENOTCONN to stat
    fstype = mount_fstype(mp)
    if fstype is None:
        if not os.path.lexists(mp):
            raise fail(f"no such directory: {mp}")
        raise fail(f"not mounted: {mp}")
    if fstype not in KVFS_FSTYPES:
        raise fail(f"not a kvfs mount ({fstype}): {mp}")
    pid = state = None
    if lazy:            # a stuck daemon must not hold the detach: ask in a child, briefly
        st = _stats_in_child(mp, LAZY_STATS_TIMEOUT)
        if st is not None:
            pid, state = int(st["pid"]), st.get("state_dir")
        else:
            dead = dead_daemon(mp)
            if dead is not None:
                detach_dead(mp, dead)
                return
    else:
        try:
            st = read_stats(mp)
            pid, state = int(st["pid"]), report_dir(st)
        except Exception as e:  # noqa: BLE001 - a dead daemon still has to be unmountable
            dead = dead_daemon(mp)
            if dead is None:    # alive but not answering: a detach is the operator's call
                raise fail(f"{e if str(e) else 'cannot read stats'}; use kvfs umount --lazy {mp}") from None
            detach_dead(mp, dead)
            return
    cmd = ["fusermount3", "-u", *(["-z"] if lazy else []), mp]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise fail("fusermount3 not found: install fuse3") from None
    if res.returncode != 0:
        why = (res.stderr or res.stdout).strip().splitlines()
        raise fail(f"cannot unmount {mp}: {why[-1] if why else 'fusermount3 failed'}")
    if pid is None:
        click.echo(f"unmounted {mp}")
        return
    if pid_alive(pid):
        with stderr.status(f"waiting for the kvfs daemon (pid {pid}) to flush and exit…"):
            done = wait_until(lambda: not pid_alive(pid), timeout, interval=0.05)
        if not done:
            raise fail(f"unmounted {mp}, but daemon pid {pid} is still running after {timeout:.0f}s")
    if state is not None and not lazy:
        _check_unmount_report(mp, pid, state)
    click.echo(f"unmounted {mp}")


def _stats_in_child(mp: str, timeout: float) -> dict | None:
    """``.kvfs/stats`` read by a forked child, or None if it has not answered in ``timeout``
    seconds (a stopped or dying daemon: the child is killed and left to its fate; a read of a
    FUSE file waits killably, but a daemon stuck in uninterruptible I/O may keep it a while)."""
    r, w = os.pipe()
    child = os.fork()
    if child == 0:                  # pragma: no cover - the child
        try:
            os.close(r)
            os.write(w, json.dumps(read_stats(mp)).encode())
        finally:
            os._exit(0)
    os.close(w)
    data, deadline = b"", time.monotonic() + timeout
    try:
        while (left := deadline - time.monotonic()) > 0 and select.select([r], [], [], left)[0]:
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            data += chunk
        else:
            os.kill(child, signal.SIGKILL)
            data = b""
    finally:
        os.close(r)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(child, os.WNOHANG)
    try:
        st = json.loads(data) if data else None
    except ValueError:
        return None
    return st if isinstance(st, dict) and "pid" in st else None


def report_dir(st: dict) -> Path | None:
    """The state directory where the daemon of stats ``st`` leaves its unmount report; None
    for a daemon that does not announce one (older than the report: nothing to check)."""
    state = st.get("state_dir")
    return Path(state) if state and st.get(UNMOUNT_REPORT_KEY) else None


def _check_unmount_report(mp: str, pid: int, state: Path) -> None:
    """Fail (exit 1) unless the daemon reported that its clean unmount kept every file."""
    try:
        report = json.loads((state / UNMOUNT_REPORT).read_text())
    except (OSError, ValueError):
        report = None
    if not isinstance(report, dict) or report.get("pid") != pid:
        raise fail(f"unmounted {mp}, but the daemon (pid {pid}) exited without reporting a clean "
                   f"unmount (see {state / 'kvfs.log'})")
    lost = int(report.get("lost") or 0)
    if lost:
        raise fail(f"unmounted {mp}, but {lost} of {report.get('ram_only')} RAM-only files could not "
                   f"be kept across the restart (see {state / 'kvfs.log'})")


# ---- a mount whose daemon is dead -----------------------------------------------------------
def _daemon_alive(pid) -> bool:
    """``pid`` runs and is a kvfs daemon (not another process given a reused pid)."""
    if not isinstance(pid, int) or not pid_alive(pid):
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"kvfs" in f.read()
    except OSError:
        return False


def dead_daemon(mp: str) -> dict | None:
    """The mount record of ``mp`` (kvfs/mountrecord.py; {} if there is none) when its daemon
    is dead: the recorded daemon (and its supervisor, if any) no longer runs, or (no record: a daemon older than the
    record) the mount answers ENOTCONN, the connection gone with the daemon. None while a
    daemon may still serve it (a stuck one: never waited on here)."""
    from kvfs import mountrecord
    rec = mountrecord.read(mp)
    if rec is not None:
        # a supervised mount's daemon may be between two lives: dead only with its supervisor
        alive = _daemon_alive(rec.get("pid")) or _daemon_alive(rec.get("supervisor"))
        return None if alive else rec
    err = _stats_errno_in_child(mp, LAZY_STATS_TIMEOUT)
    return {} if err in (errno.ENOTCONN, errno.ECONNABORTED) else None


def _stats_errno_in_child(mp: str, timeout: float) -> int | None:
    """The errno of reading ``.kvfs/stats`` in a forked child (0: it answered), or None when
    it has not answered in ``timeout`` seconds (a stuck daemon: the child is killed)."""
    r, w = os.pipe()
    child = os.fork()
    if child == 0:                  # pragma: no cover - the child
        code = 0
        try:
            os.close(r)
            with open(Path(mp) / STATS_NAME, "rb") as f:
                f.read()
        except OSError as e:
            code = e.errno or errno.EIO
        except BaseException:       # noqa: BLE001
            code = errno.EIO
        finally:
            os.write(w, str(code).encode())
            os._exit(0)
    os.close(w)
    try:
        ready = select.select([r], [], [], timeout)[0]
        data = os.read(r, 64) if ready else b""
    finally:
        os.close(r)
    if not data:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(child, 0 if data else os.WNOHANG)
    try:
        return int(data) if data else None
    except ValueError:
        return None


def _ram_tmpfs_left(rec: dict) -> list[str]:
    """The dead daemon's RAM-tier tmpfs mounts still in the mount table (kvfs.store.hugefs)."""
    from kvfs.proc import mounts
    from kvfs.store import hugefs
    shm, inst = rec.get("shm_dir"), rec.get("instance")
    if not shm or not inst:
        return []
    parent = os.path.realpath(shm)
    try:
        return [m.mountpoint for m in mounts() if m.fstype == "tmpfs"
                and os.path.dirname(m.mountpoint) == parent
                and os.path.basename(m.mountpoint).startswith(hugefs.tag(inst))]
    except OSError:
        return []


def _sweep_ram(rec: dict) -> str | None:
    """Remove what the dead daemon left in shared memory, as its next start would: its RAM
    tier's directories (their name tables retired first: readers stop answering from them)
    and its huge-page tmpfs. Returns what could not be removed (None: nothing left)."""
    from kvfs.store import hugefs, names, safedir
    shm, inst, prefix = rec.get("shm_dir"), rec.get("instance"), rec.get("ram_prefix")
    if not shm or not inst or not prefix:
        return None
    problems = []
    for step in (lambda: safedir.remove_stale_dirs(shm, prefix, before=names.retire),
                 lambda: hugefs.sweep(Path(shm), inst, prefix)):
        try:
            step()
        except Exception as e:      # noqa: BLE001 - what a tenant left must not stop the detach
            problems.append(f"{type(e).__name__}: {e}")
    for path in _ram_tmpfs_left(rec):     # a sweep that failed inside: detach the tmpfs anyway
        try:
            hugefs.detach(path)
        except OSError as e:
            problems.append(f"umount {path}: {e.strerror}")
    left = _ram_tmpfs_left(rec)
    if left:
        return f"its RAM tier's tmpfs is still mounted at {', '.join(left)} ({'; '.join(problems)})"
    if problems:
        log.warning("clearing the dead daemon's RAM tier: %s", "; ".join(problems))
    return None


def _losses(rec: dict) -> str:
    """What the next mount will drop, in words (the index's tally, read offline)."""
    from kvfs.store.tally import offline_losses
    state = rec.get("state_dir")
    if not state:
        return ("what the next mount will drop is not known here (no record of the daemon's state "
                "directory; a daemon older than this kvfs)")
    try:
        lost = offline_losses(state)
    except Exception as e:          # noqa: BLE001 - the detach is done; say why not
        return f"what the next mount will drop is not known: cannot read the index in {state} ({e})"
    n = lost["unsealed"] + lost["ram_only"]
    if not n:
        return "the next mount drops nothing: every file was sealed and on a durable tier"
    shown = ", ".join(lost["files"]) + (", ..." if n > len(lost["files"]) else "")
    return (f"the next mount will drop {n} file{'s' if n != 1 else ''}: {lost['unsealed']} never "
            f"sealed, {lost['ram_only']} whose only copy was in RAM ({shown})")


def detach_dead(mp: str, rec: dict) -> None:
    """``kvfs umount`` of a mount whose daemon is dead: detach it (lazily: there is nobody to
    flush), remove the daemon's RAM tier, say so and what the next mount will drop; exit 0
    unless the mount or the RAM tier's tmpfs stays."""
    from kvfs import mountrecord
    try:
        res = subprocess.run(["fusermount3", "-u", "-z", mp], capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise fail("fusermount3 not found: install fuse3") from None
    if res.returncode != 0:
        why = (res.stderr or res.stdout).strip().splitlines()
        raise fail(f"cannot detach {mp} (its daemon is dead): {why[-1] if why else 'fusermount3 failed'}")
    who = f" (pid {rec['pid']})" if isinstance(rec.get("pid"), int) else ""
    click.echo(f"the kvfs daemon of {mp}{who} was dead: detached {mp}")
    click.echo(_losses(rec))
    left = _sweep_ram(rec)
    mountrecord.remove(mp)
    if left:
        raise fail(f"detached {mp}, but {left}")
