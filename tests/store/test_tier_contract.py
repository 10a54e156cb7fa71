"""One contract, run over every tier: RAM (tmpfs), NVMe (directory), remote over a volume file.
The same contract runs over the real NVMe/TCP target in tests/remote/test_contract_target.py."""
from __future__ import annotations

import os

import pytest
import trio


from support.store import contract, file_remote_tier, info, nvme_tier, ram_tier

FACTORIES = {"ram": ram_tier, "nvme": nvme_tier, "remote-file": file_remote_tier}


@pytest.mark.parametrize("kind", sorted(FACTORIES))
async def test_tier_contract(kind, tmp_path):
    tier = await FACTORIES[kind](tmp_path)
    try:
        await contract(tier)
    finally:
        await tier.close()


def test_backing_paths_point_at_the_bytes(tmp_path):
    async def main():
        for make in (ram_tier, nvme_tier):
            tier = await make(tmp_path)
            data = os.urandom(3 << 20)      # RAM objects under 1 MiB have no backing file
            loc = await tier.put(info(9, data), memoryview(data))
            b = tier.backing(9, loc)
            with open(b["path"], "rb") as f:
                f.seek(b["offset"])
                assert f.read(len(data)) == data
            await tier.close()
    trio.run(main)
