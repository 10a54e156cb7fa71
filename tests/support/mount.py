"""kvfs through its CLI: real mounts in a subprocess, the command, polling with a deadline.

``kvfs_mount(*extra_args, ram="64MiB", nvme_size="1GiB", **options)`` mounts a
fresh kvfs (its own mountpoint, NVMe directory and state directory under
``tmp_path``) with ``kvfs mount`` and returns a :class:`Mount`.  Keyword options
become flags (``nvme_size="1GiB"`` -> ``--nvme-size 1GiB``; ``True`` -> a bare
flag; ``None``/``False`` -> omitted).  Every mount is torn down at the end of
the test whatever happened: ``fusermount3 -u -z``, then SIGKILL of the daemon.
``open_mount`` mounts outside that fixture; ``mnt`` and ``d`` are one mount per test
module (a module imports both to use them).

``kvfs_cli(*args)`` runs the ``kvfs`` command and returns the CompletedProcess.

Tests that mount are marked ``@pytest.mark.mount``; they are skipped only when
``/dev/fuse`` is missing (``support.session``).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvfs.proc import pid_alive

REPO = Path(__file__).resolve().parents[2]
HAVE_FUSE = os.path.exists("/dev/fuse")
MOUNT_TIMEOUT = 120.0      # generous: a 2-core CI machine may be busy
EXIT_TIMEOUT = 120.0


def kvfs_command() -> list[str]:
    """The argv prefix that runs the kvfs CLI of this checkout."""
    return [sys.executable, "-m", "kvfs.cli"]


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def run_kvfs(*args, timeout: float = MOUNT_TIMEOUT, input: str | None = None,
             env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``kvfs ARGS`` (``env`` adds to the environment) and return the CompletedProcess."""
    return subprocess.run(
        [*kvfs_command(), *map(str, args)],
        capture_output=True, text=True, timeout=timeout, env={**_env(), **(env or {})}, input=input,
        stdin=None if input is not None else subprocess.DEVNULL,
    )


def wait_for(predicate, timeout: float, what: str, interval: float = 0.01):
    """Poll ``predicate`` until it returns a truthy value or the deadline passes."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def lazy_unmount(path: Path) -> None:
    subprocess.run(["fusermount3", "-u", "-z", str(path)], capture_output=True, timeout=60)


NEGATABLE = {"passthrough"}     # options whose False is a ``--no-`` flag (the others: left out)


def _flags(options: dict) -> list[str]:
    out: list[str] = []
    for key, val in options.items():
        flag = "--" + key.replace("_", "-")
        if val is False and key in NEGATABLE:
            out.append("--no-" + key.replace("_", "-"))
            continue
        if val is None or val is False:
            continue
        if val is True:
            out.append(flag)
        else:
            out += [flag, str(val)]
    return out


class Mount:
    """One kvfs mount driven through the CLI."""

    def __init__(self, root: Path, extra_args: tuple, options: dict):
        self.path = root / "mnt"
        self.nvme = Path(options.pop("nvme", root / "nvme"))
        self.state = Path(options.pop("state", root / "state"))
        self.path.mkdir(parents=True, exist_ok=True)
        self.args: list[str] = [
            "--nvme", str(self.nvme), "--state", str(self.state),
            *_flags(options), *map(str, extra_args),
        ]
        self.pid: int | None = None
        self.supervisor: int | None = None     # its supervisor's pid (a --supervise mount)
        self._pids: set[int] = set()
        self._ram_dirs: set[str] = set()      # the daemons' RAM tiers, in shared memory

    # -- lifecycle ---------------------------------------------------------
    def mount(self) -> "Mount":
        res = run_kvfs("mount", self.path, *self.args)
        assert res.returncode == 0, (
            f"kvfs mount failed (rc={res.returncode}): {res.stderr.strip()}\n{self.log_tail()}")
        assert os.path.ismount(self.path), "kvfs mount returned 0 but nothing is mounted"
        st = self.stats()
        self.pid = int(st["pid"])
        self._pids.add(self.pid)
        self.supervisor = (st.get("supervisor") or {}).get("pid")
        if self.supervisor:             # kvfs/supervisor.py: torn down with it
            self._pids.add(int(self.supervisor))
        self._ram_dirs.add(st["ram_dir"])
        return self

    def umount(self) -> subprocess.CompletedProcess:
        res = run_kvfs("umount", self.path, timeout=EXIT_TIMEOUT + 30)
        assert res.returncode == 0, (
            f"kvfs umount failed (rc={res.returncode}): {res.stderr.strip()}\n{self.log_tail()}")
        assert not os.path.ismount(self.path)
        if self.pid is not None:
            assert not pid_alive(self.pid), "kvfs umount returned but the daemon still runs"
        return res

    def remount(self) -> "Mount":
        self.umount()
        return self.mount()

    def kill9(self) -> None:
        """SIGKILL the daemon (no flush, no clean shutdown), then detach the dead mount."""
        pid = self.pid if self.pid is not None else int(self.stats()["pid"])
        if getattr(self, "supervisor", None):
            # a supervised mount: the supervisor first, or it would start the next daemon
            # (tests/mount/test_mnt_supervisor.py kills the daemon alone)
            os.kill(int(self.supervisor), signal.SIGKILL)
            wait_for(lambda: not pid_alive(int(self.supervisor)), EXIT_TIMEOUT, "the supervisor to die")
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not pid_alive(pid), EXIT_TIMEOUT, f"daemon {pid} to die")
        lazy_unmount(self.path)
        wait_for(lambda: not os.path.ismount(self.path), 30, "the mount to go away")
        self.pid = None

    def stats(self) -> dict:
        with open(self.path / ".kvfs" / "stats", "rb") as f:
            return json.loads(f.read())

    def log_tail(self, lines: int = 40) -> str:
        log = self.state / "kvfs.log"
        try:
            text = log.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return f"(no log at {log})"
        return "--- kvfs.log (tail) ---\n" + "\n".join(text)

    def cleanup(self) -> None:
        # unconditionally: a dead daemon's mount fails stat() (ENOTCONN), so ismount says False
        lazy_unmount(self.path)
        for pid in self._pids:              # detached: a daemon shuts down (and frees its RAM tier)
            try:
                wait_for(lambda: not pid_alive(pid), 15, f"daemon {pid} to exit")
            except AssertionError:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for pid in self._pids:
            try:
                wait_for(lambda: not pid_alive(pid), 30, f"daemon {pid} to die")
            except AssertionError:
                pass
        # a killed daemon leaves its RAM tier in /dev/shm (a restart on the same state would
        # clear it; a test's state is thrown away): do not leak it into the machine's memory
        for d in self._ram_dirs:
            shutil.rmtree(d, ignore_errors=True)
            top = Path(d).parent                   # the daemon's own tmpfs (kvfs.store.hugefs)
            if ".hugefs-" in top.name and os.path.ismount(top):
                subprocess.run(["umount", "-l", str(top)], capture_output=True)
                with contextlib.suppress(OSError):
                    top.rmdir()

    def __repr__(self) -> str:
        return f"<Mount {self.path} pid={self.pid}>"


@pytest.fixture
def kvfs_mount(tmp_path):
    """Factory: ``kvfs_mount(*extra_args, ram="64MiB", nvme_size="1GiB", **options)``."""
    if not HAVE_FUSE:
        pytest.skip("/dev/fuse is missing on this machine")
    mounts: list[Mount] = []

    def factory(*extra_args, ram="64MiB", nvme_size="1GiB", **options) -> Mount:
        root = tmp_path / f"kvfs{len(mounts)}"
        root.mkdir()
        m = Mount(root, extra_args, {"ram": ram, "nvme_size": nvme_size, **options})
        mounts.append(m)
        return m.mount()

    yield factory
    for m in mounts:
        m.cleanup()


@pytest.fixture
def kvfs_cli():
    """Run the kvfs CLI: ``kvfs_cli("stat", path, "--json")`` -> CompletedProcess."""
    return run_kvfs


def assert_one_line_error(res: subprocess.CompletedProcess, *needles: str, code: int | None = None):
    err = res.stderr.strip()
    assert res.returncode != 0, f"expected failure, got rc=0; stdout={res.stdout!r}"
    if code is not None:
        assert res.returncode == code
    assert "\n" not in err, f"error is not one line: {err!r}"
    assert err.startswith("kvfs: error: "), err
    assert "Traceback" not in res.stderr + res.stdout
    for n in needles:
        assert n.lower() in err.lower(), f"{n!r} not in {err!r}"
    return err


def stats_json(mount) -> dict:
    res = run_kvfs("stat", mount.path, "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def tier_total(st: dict, key: str) -> int:
    return sum(t.get(key, 0) for t in st["tiers"].values())


def open_mount(root: Path, *extra_args, ram="64MiB", nvme_size="1GiB", **options):
    """A mount outside the function-scoped ``kvfs_mount`` fixture (caller calls ``cleanup``)."""
    root.mkdir(parents=True, exist_ok=True)
    return Mount(root, extra_args, {"ram": ram, "nvme_size": nvme_size, **options}).mount()


@pytest.fixture(scope="module")
def mnt(tmp_path_factory):
    """One mount per test module (import this fixture and ``d`` into the module)."""
    m = open_mount(tmp_path_factory.mktemp("kvfs-mod") / "kvfs")
    yield m
    m.cleanup()


@pytest.fixture
def d(mnt, request) -> Path:
    """A fresh directory for the test inside the module's mount."""
    p = mnt.path / request.node.name.replace("[", "_").replace("]", "_")
    p.mkdir()
    return p


def scrape(m) -> dict:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families
    """``{(name, (label values sorted by label name)): value}`` of the daemon's /metrics."""
    addr = m.stats()["metrics"]
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=30) as r:
        assert r.status == 200
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(v for _, v in sorted(s.labels.items())))] = s.value
    return out


def abort_conn(conn: int) -> None:
    """Free the clients of a wedged FUSE connection (what an operator does by hand)."""
    ctl = "/sys/fs/fuse/connections"
    if not os.path.exists(f"{ctl}/{conn}"):
        subprocess.run(["mount", "-t", "fusectl", "none", ctl], capture_output=True)
    try:
        with open(f"{ctl}/{conn}/abort", "w") as f:
            f.write("1")
    except OSError:
        pass
