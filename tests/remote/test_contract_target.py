"""The store's tier contract (tests/store/storekit.py) over the remote tier on the real target."""

import pytest
import trio


from storekit import contract  # noqa: E402


@pytest.mark.target
async def test_tier_contract_real_target(remote_tier):
    await contract(remote_tier)
