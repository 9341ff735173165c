"""Admin bases for the tables that code writes and the admin only reads (the job ledger, the webhook outbox)."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest


class ReadOnlyInline(admin.TabularInline):
    """A parent's log rows (stage runs, delivery attempts): ``fields`` shown read-only, none added or deleted."""

    extra = 0
    can_delete = False

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return list(self.fields or ())

    def has_add_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False


class ReadOnlyAdmin(admin.ModelAdmin):
    """A table written by code only: every field of the model read-only, no row added from the admin."""

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return [f.name for f in self.model._meta.fields]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False
