"""Settings of the web process and reconciler that the ledger tests start.

``onepiece up``'s own (``settings.local``: SQLite in WAL with immediate
transactions), with the database the test names (``LEDGER_TEST_PG_PORT``: the
fixture's PostgreSQL instead) and short grace periods, so a fault's
consequences are decided within the test's time.
"""

import os

from onepiece_platform.settings.local import *  # noqa: F403

if os.environ.get("LEDGER_TEST_PG_PORT"):
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": "onepiece",
            "USER": "postgres",
            "HOST": "127.0.0.1",
            "PORT": os.environ["LEDGER_TEST_PG_PORT"],
            "CONN_MAX_AGE": 60,
            "OPTIONS": {"application_name": os.environ.get("LEDGER_TEST_APP_NAME", "onepiece")},
        }
    }

ONEPIECE = {**ONEPIECE, "LOST_AFTER_S": 6.0, "HOLD_UNKNOWN_S": 5.0}  # noqa: F405

# what a 500 was, in the process's log (DEBUG is off, so Django's default logging would keep it to itself)
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"django.request": {"handlers": ["console"], "level": "ERROR"}},
    "root": {"handlers": ["console"], "level": "WARNING"},
}
