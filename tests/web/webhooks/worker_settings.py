"""Settings of the delivery workers (and set-up scripts) that the process tests start.

``onepiece up``'s own (``settings.local``: SQLite in WAL with immediate transactions, private
receivers allowed) with the database the test names (``WEBHOOK_TEST_PG_PORT``: the fixture's
PostgreSQL; else the SQLite file ``WEBHOOK_TEST_SQLITE``) and the webhook settings it passes as JSON
in ``WEBHOOK_TEST_ONEPIECE`` (retries in fractions of a second, short leases).
"""

import json
import os

from onepiece_platform.settings.local import *  # noqa: F403

if os.environ.get("WEBHOOK_TEST_PG_PORT"):
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": "onepiece",
            "USER": "postgres",
            "HOST": "127.0.0.1",
            "PORT": os.environ["WEBHOOK_TEST_PG_PORT"],
            "CONN_MAX_AGE": 60,
        }
    }
else:
    DATABASES["default"]["NAME"] = os.environ["WEBHOOK_TEST_SQLITE"]

ONEPIECE = {**ONEPIECE, **json.loads(os.environ.get("WEBHOOK_TEST_ONEPIECE", "{}"))}  # noqa: F405

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": "WARNING"},
}
