"""The web tests' fixtures are plugins (tests.fixtures.web, .celery, .workers, .proxy, .postgres).

The names below are re-exported only for test files written before the move; import them from
tests.fixtures.web instead.
"""

from tests.fixtures.web import WEB_DB, client_for, make_user, png, sd_body, wan_body

__all__ = ["WEB_DB", "client_for", "make_user", "png", "sd_body", "wan_body"]
