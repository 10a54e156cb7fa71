"""``kvfs restart``: a new daemon for a supervised mount (kvfs/supervisor.py), without an unmount."""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import click

from kvfs.cli.common import CLIError, fail, read_stats, wait_until
from kvfs.handover import SOCKET_NAME     # the socket's protocol only: no daemon code here


def ask_supervisor(state_dir: str, msg: dict, timeout: float = 30.0) -> dict:
    """One request on the supervisor's root-only socket; its one-line JSON answer."""
    path = str(Path(state_dir) / SOCKET_NAME)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        try:
            s.connect(path)
            s.sendall((json.dumps(msg) + "\n").encode())
            buf = b""
            while b"\n" not in buf:
                chunk = s.recv(4096)
                if not chunk:
                    break
                buf += chunk
        except OSError as e:
            raise fail(f"cannot reach the supervisor at {path}: {e.strerror or e}") from None
    try:
        return json.loads(buf.split(b"\n")[0])
    except ValueError:
        raise fail(f"the supervisor at {path} did not answer") from None


def _supervised(mp: str) -> tuple[dict, dict]:
    st = read_stats(mp)
    sup = st.get("supervisor") or {}
    if not sup.get("pid"):
        raise fail(f"{mp} has no supervisor ({sup.get('state', 'mounted without --supervise')}): "
                   f"kvfs umount and mount it again instead")
    return st, sup


def _restart(mp: str, st: dict, sup: dict, timeout: float) -> None:
    old, epoch = int(st["pid"]), int(sup.get("epoch") or 0)
    answer = ask_supervisor(st["state_dir"], {"op": "restart"})
    if not answer.get("ok"):
        raise fail(f"the supervisor refused: {answer.get('why')}")
    t0 = time.monotonic()
    seen: list = []

    def served():
        try:
            now = read_stats(mp)
        except CLIError:
            return False
        if int(now["pid"]) != old and int((now.get("supervisor") or {}).get("epoch") or 0) > epoch:
            seen.append(now)
            return True
        return False
    if not wait_until(served, timeout, interval=0.05):
        raise fail(f"no new daemon served {mp} within {timeout:.0f}s (see {st['state_dir']}/kvfs.log)")
    click.echo(f"restarted {mp}: daemon {old} -> {seen[0]['pid']} in {time.monotonic() - t0:.2f}s")


@click.command("restart")
@click.argument("mountpoint")
@click.option("--timeout", type=float, default=600.0, show_default=True,
              help="Seconds to wait for the new daemon to serve.")
def restart_cmd(mountpoint, timeout):
    """Replace the daemon of the supervised mount at MOUNTPOINT: the old one answers the
    requests it read and writes RAM-only files down, the next one takes the session over.
    Processes using the mount see a pause, not an error."""
    mp = os.path.abspath(mountpoint)
    st, sup = _supervised(mp)
    _restart(mp, st, sup, timeout)


@click.command("upgrade")
@click.argument("mountpoint")
@click.option("--timeout", type=float, default=600.0, show_default=True,
              help="Seconds to wait for the new supervisor image and the new daemon.")
def upgrade_cmd(mountpoint, timeout):
    """Run the kvfs installed now under the supervised mount at MOUNTPOINT, without unmounting:
    the supervisor re-executes itself (holding the mount's session, its daemon and its
    socket), then the daemon is replaced as by ``kvfs restart``."""
    mp = os.path.abspath(mountpoint)
    st, sup = _supervised(mp)
    state = st["state_dir"]
    before = ask_supervisor(state, {"op": "status"}).get("image")
    answer = ask_supervisor(state, {"op": "reexec"})
    if not answer.get("ok"):
        raise fail(f"the supervisor refused: {answer.get('why')}")

    def new_image():
        try:
            got = ask_supervisor(state, {"op": "status"}, timeout=5)
        except CLIError:
            return False
        return got.get("image") not in (None, before)
    if not wait_until(new_image, timeout, interval=0.05):
        raise fail(f"the supervisor did not come back from its re-exec within {timeout:.0f}s "
                   f"(see {state}/kvfs.log)")
    click.echo(f"supervisor {sup['pid']} runs the installed kvfs")
    _restart(mp, st, sup, timeout)
