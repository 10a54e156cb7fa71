"""pytest fixtures around the real nvmet-tcp target (``support.nvmet``; tests/conftest.py
registers them).

* ``nvmet_target`` (session): one VM for the whole run, 1 GiB namespace image on the host.
* ``remote_url``: the session target's URL (string).
* ``remote_tier``: a freshly formatted, opened RemoteTier on the session target with its
  ``serve()`` running; closed after the test. Capacity 256 MiB.
* ``fresh_target``: a VM of the test's own (for tests that kill or restart it).
"""
from __future__ import annotations

import uuid

import pytest
import trio

from support.nvmet import Target, ensure_initramfs


def _boot(image, size=1 << 30) -> Target:
    ensure_initramfs()
    t = Target(image, size=size)
    t.start()
    return t


@pytest.fixture(scope="session")
def nvmet_target(tmp_path_factory):
    t = _boot(tmp_path_factory.mktemp("nvmet") / "namespace.img")
    try:
        yield t
    finally:
        t.kill()


@pytest.fixture
def fresh_target(tmp_path):
    t = _boot(tmp_path / "namespace.img", size=256 << 20)
    try:
        yield t
    finally:
        t.kill()


@pytest.fixture
def remote_url(nvmet_target) -> str:
    if not nvmet_target.alive():
        nvmet_target.start()
    return nvmet_target.url


async def open_tier(url: str, *, instance_id: str | None = None, size="256MiB", fmt=True):
    from kvfs.remote import make_volume
    from kvfs.remote.tier import RemoteTier
    iid = instance_id or f"test-{uuid.uuid4().hex[:8]}"
    t = RemoteTier(make_volume(url, instance_id=iid), instance_id=iid, size=size, format=fmt,
                   describe=url.split("?", 1)[0])
    await t.open()
    return t


@pytest.fixture
async def remote_tier(remote_url):
    tier = await open_tier(remote_url)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(tier.serve)
        yield tier
        nursery.cancel_scope.cancel()
    await tier.close()
