#!/usr/bin/env python
"""Django's command-line utility for the OnePiece platform.

platform/ is a source folder, not a package (a package named ``platform``
would shadow the standard library's module), so it goes on sys.path here.
"""

import os
import sys
from pathlib import Path


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent / "platform"))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "onepiece_platform.settings.local")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
