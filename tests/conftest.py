"""Fixtures every test module shares."""

import pytest

from . import workers


@pytest.fixture(autouse=True, scope="module")
def _shared_processes_last_one_module():
    """The processes ``workers.run`` starts serve the tests of one module, then stop."""
    yield
    workers.close_all()
