"""The admin's pages for API keys (listed and revoked, never issued there) and the read-only audit log."""

from django.contrib import admin
from django.http import HttpRequest

from onepiece_platform.accounts.models import ApiKey, AuditEntry


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ["prefix", "user", "name", "max_priority", "created_at", "expires_at", "revoked_at",
                    "last_used_at"]
    list_filter = ["revoked_at", "expires_at", "max_priority"]
    search_fields = ["prefix", "user__username", "name"]
    readonly_fields = ["prefix", "secret_hash", "created_at", "last_used_at"]
    actions = ["revoke"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        # keys are issued through the API or `manage.py ensure_demo_user`, where the secret can be shown once
        return False

    @admin.action(description="Revoke selected keys")
    def revoke(self, request: HttpRequest, queryset) -> None:  # type: ignore[no-untyped-def]
        for key in queryset:
            key.revoke()


@admin.register(AuditEntry)
class AuditEntryAdmin(admin.ModelAdmin):
    list_display = ["at", "actor", "action", "target"]
    list_filter = ["action"]
    search_fields = ["target", "actor__username", "action"]
    readonly_fields = ["at", "actor", "action", "target", "detail"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False
