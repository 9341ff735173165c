"""Create the demo user and its API key once; print ``api key: <key>``.

The key's secret is stored hashed, so the full key is kept in a file (mode
0600) in the state directory to print it again on later runs; a missing file
or a revoked key means a new key is issued.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand

from onepiece_platform.accounts.models import ApiKey, split_key


class Command(BaseCommand):
    help = "Create the demo user and an API key for it (idempotent); prints 'api key: <key>'."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--username", default="demo")
        parser.add_argument("--key-file", default=None, help="default: <state dir>/demo-api-key")

    def handle(self, *args: Any, **opts: Any) -> None:
        user, _ = get_user_model().objects.get_or_create(username=opts["username"], defaults={"is_active": True})
        path = Path(opts["key_file"] or Path(settings.STATE_DIR) / "demo-api-key")
        raw = path.read_text().strip() if path.exists() else ""
        parts = split_key(raw)
        key = ApiKey.objects.filter(user=user, prefix=parts[0]).first() if parts else None
        if key is None or parts is None or not key.matches(parts[1]) or not key.active:
            _, raw = ApiKey.issue(user, name="demo")
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(raw + "\n")
        self.stdout.write(f"api key: {raw}")
