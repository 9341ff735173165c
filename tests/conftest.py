"""The shared fixtures are plugins in tests/fixtures/ (see its __init__), registered here for every test."""

pytest_plugins = [
    "tests.fixtures.services",
    "tests.fixtures.leaks",
    "tests.fixtures.markers",
    "tests.fixtures.models",
    "tests.fixtures.web",
    "tests.fixtures.celery",
    "tests.fixtures.workers",
    "tests.fixtures.proxy",
    "tests.fixtures.postgres",
    "tests.fixtures.objects",
]
