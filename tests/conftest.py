"""The shared fixtures are plugins in tests/fixtures/ (see its __init__), registered here for every test."""

from __future__ import annotations

from tests.fixtures import REPO_ROOT
from tests.fixtures.services import PROXY_TOKEN

pytest_plugins = ["tests.fixtures.services", "tests.fixtures.leaks"]

__all__ = ["PROXY_TOKEN", "REPO_ROOT"]
