"""
pytest configuration for the whole suite (`python -m pytest -q`): the root of the project is on sys.path (this
file's folder), the `quick` marker selects the algorithm's fast tests (`python -m pytest -q -m quick`), and one
SFT cache is shared by every test that runs the tiny preset.
"""

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "quick: the algorithm's fast tests (no processes, no training run)")


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tba-cache")
