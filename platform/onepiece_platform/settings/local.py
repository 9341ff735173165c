"""Embedded defaults for one machine (`onepiece up`)."""

from onepiece_platform.settings.base import *  # noqa: F403

DEBUG = True
