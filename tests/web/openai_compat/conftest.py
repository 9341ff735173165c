"""The OpenAI-compatible API tests' fixtures are plugins (tests.fixtures.workers).

Re-exported only for test files written before the move; use tests.fixtures.workers instead.
"""

from tests.fixtures.workers import Workers, mp4, oa, workers

__all__ = ["Workers", "mp4", "oa", "workers"]
