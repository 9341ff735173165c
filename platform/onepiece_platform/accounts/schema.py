"""drf-spectacular description of the Bearer scheme (imported by apps.ready)."""

from drf_spectacular.extensions import OpenApiAuthenticationExtension


class ApiKeyScheme(OpenApiAuthenticationExtension):
    target_class = "onepiece_platform.accounts.authentication.ApiKeyAuthentication"
    name = "ApiKey"

    def get_security_definition(self, auto_schema):  # type: ignore[no-untyped-def]
        return {"type": "http", "scheme": "bearer", "description": "an API key: op_<prefix>_<secret>"}
