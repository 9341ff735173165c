"""Django app config of jobs (the job ledger)."""

from django.apps import AppConfig


class JobsConfig(AppConfig):
    name = "onepiece_platform.jobs"
    label = "jobs"
    verbose_name = "Jobs (the ledger)"

    def ready(self) -> None:
        from onepiece_platform.jobs import signals  # noqa: F401  (connects the receivers)
