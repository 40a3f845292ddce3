"""The two-host rig (``support.hosts.Rig``) for this folder's tests: made once per session, torn
down after. It skips only where a rig cannot exist (not root, no network namespaces, a program
missing: ``bash scripts/setup.sh --hosts`` installs them); under CI it runs."""

import pytest


@pytest.fixture(scope="session")
def rig():
    from support import hosts

    why = hosts.missing()
    if why:
        pytest.skip(f"two-host rig: {why}")
    with hosts.Rig() as r:
        yield r
