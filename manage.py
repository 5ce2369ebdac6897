#!/usr/bin/env python
"""Roundhouse's command-line utility: puts platform/ on sys.path, then runs Django."""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent


def main() -> None:
    # platform/ is a folder, not a package: its subfolders (roundhouse, fleet,
    # catalog, api, chat) become importable by their own names, and the standard
    # library's `platform` module stays unshadowed.
    for path in (str(ROOT), str(ROOT / "platform")):
        if path not in sys.path:
            sys.path.insert(0, path)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "roundhouse.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
