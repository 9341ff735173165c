"""What the debug error page (``onepiece up --debug``) may show of the settings."""

from __future__ import annotations

import re

from django.views.debug import SafeExceptionReporterFilter


class RedactingReporterFilter(SafeExceptionReporterFilter):
    """Django's filter hides settings named like API, TOKEN, KEY, SECRET, PASS or SIGNATURE; service URLs
    carry passwords too (``ONEPIECE_ETCD_URL``, ``ONEPIECE_REDIS_URL``, the database's), so any setting
    named like URL, DSN or DATABASES is hidden as well."""

    hidden_settings = re.compile("API|TOKEN|KEY|SECRET|PASS|SIGNATURE|URL|DSN|DATABASES|CACHES|BROKER|CHANNEL",
                                 flags=re.IGNORECASE)
