"""Create (or update) the local staff user with the password read from stdin.

``onepiece up`` keeps the password in its state folder (mode 0600) and pipes
it here: a password on a command line is visible to every user of the host
(``ps``, ``/proc/<pid>/cmdline``).
"""

from __future__ import annotations

import sys
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError


class Command(BaseCommand):
    help = "Create or update a staff superuser; the password is read from the first line of stdin."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--username", default="admin")

    def handle(self, *args: Any, **opts: Any) -> None:
        password = sys.stdin.readline().strip()
        if not password:
            raise CommandError("no password on stdin")
        user, _ = get_user_model().objects.get_or_create(username=opts["username"])
        user.set_password(password)
        user.is_staff = user.is_superuser = True
        user.save()
