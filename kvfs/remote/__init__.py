"""The remote tier: a userspace NVMe/TCP initiator (or a kernel block device / file) under an
object store laid out on the raw volume. ``make_remote_tier`` is what the store calls."""
from __future__ import annotations

import logging

from kvfs.errors import ConfigError

log = logging.getLogger(__name__)


def make_volume(target: str, *, instance_id: str = "", create_size: int = 0, read_only: bool = False):
    """A Volume for ``nvme-tcp://…`` or a block-device/file path (ConfigError on a bad URL);
    ``read_only``: a file or device is opened O_RDONLY (an NVMe/TCP volume is only read by
    its caller)."""
    from kvfs.remote.errors import UrlError
    from kvfs.remote.url import is_nvme_tcp, parse_url
    if is_nvme_tcp(target):
        from kvfs.remote.volume import NvmeTcpVolume
        try:
            return NvmeTcpVolume(parse_url(target, instance_id=instance_id))
        except UrlError as e:
            raise ConfigError(f"bad --remote URL: {e}") from None
    if "://" in target:
        raise ConfigError(f"bad --remote {target!r}: use nvme-tcp://HOST:PORT/SUBNQN or a device/file path")
    from kvfs.remote.blockdev import FileVolume
    return FileVolume(target, create_size=create_size, read_only=read_only)


def make_remote_tier(target: str, instance_id: str, *, size: str | int = "100%", format: bool = False,
                     shared: dict | None = None):
    """Build (not open) the RemoteTier on ``target`` (a URL or a device/file path): ``size``
    is its budget (bytes, or ``%`` of the volume; a byte size creates a missing file of that
    size), ``format`` formats the volume at open. ``shared``: the volume is shared by several
    nodes, with these SharedRemoteTier options (node_id, max_nodes, poll, lease, grace,
    takeover)."""
    from kvfs.remote.tier import RemoteTier
    from kvfs.units import parse_size
    target = target.strip()
    if not target:
        raise ConfigError("no --remote given")
    create = 0
    if not str(size).strip().endswith("%"):
        create = parse_size(size)
    vol = make_volume(target, instance_id=instance_id, create_size=create)
    describe = target.split("?", 1)[0]
    if shared is not None:
        from kvfs.remote.share.tier import SharedRemoteTier
        url = getattr(vol, "url", None)
        return SharedRemoteTier(vol, instance_id=instance_id, hostnqn=url.hostnqn if url is not None else "",
                                format=format, describe=describe, **shared)
    return RemoteTier(vol, instance_id=instance_id, size=size, format=format, describe=describe)


__all__ = ["make_remote_tier", "make_volume"]
