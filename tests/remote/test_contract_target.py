"""The store's tier contract (tests/support/store.py) over the remote tier on the real target."""

import pytest
import trio


from support.store import contract  # noqa: E402


@pytest.mark.target
async def test_tier_contract_real_target(remote_tier):
    await contract(remote_tier)
