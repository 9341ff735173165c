"""The admin's pages for API keys (listed and revoked, never issued there), users' priority tiers and the
read-only audit log."""

from django.contrib import admin
from django.http import HttpRequest

from onepiece_platform.accounts.models import ApiKey, AuditEntry, PriorityTier


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ["prefix", "user", "name", "max_priority", "allowed", "created_at", "expires_at", "revoked_at",
                    "last_used_at"]
    list_filter = ["revoked_at", "expires_at", "max_priority"]
    search_fields = ["prefix", "user__username", "name"]
    list_select_related = ["user", "user__priority_tier"]
    readonly_fields = ["prefix", "secret_hash", "created_at", "last_used_at"]
    actions = ["revoke"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        # keys are issued through the API or `manage.py ensure_demo_user`, where the secret can be shown once
        return False

    @admin.display(description="may use")
    def allowed(self, obj: ApiKey) -> str:
        """What the key may use: its owner's tier, or its own setting where lower."""
        return obj.max_priority_allowed

    @admin.action(description="Revoke selected keys")
    def revoke(self, request: HttpRequest, queryset) -> None:  # type: ignore[no-untyped-def]
        for key in queryset:
            key.revoke()


@admin.register(PriorityTier)
class PriorityTierAdmin(admin.ModelAdmin):
    """A user's tier, for every key and session of the user; users without one: high for staff, else normal."""

    list_display = ["user", "max_priority"]
    list_filter = ["max_priority"]
    search_fields = ["user__username"]
    autocomplete_fields = ["user"]


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
