"""ASGI entry: HTTP through Django, websockets through Channels.

Websockets pass the Origin check (AllowedHostsOriginValidator: a page from
another site cannot open a socket with the user's cookies) and carry the
Django session (AuthMiddlewareStack); consumers refuse anonymous users.
"""

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "onepiece_platform.settings.local")

from channels.auth import AuthMiddlewareStack
from channels.routing import ProtocolTypeRouter, URLRouter
from channels.security.websocket import AllowedHostsOriginValidator
from django.core.asgi import get_asgi_application

django_asgi_app = get_asgi_application()

from onepiece_platform.routing import websocket_urlpatterns  # noqa: E402 - needs the apps loaded

application = ProtocolTypeRouter({
    "http": django_asgi_app,
    "websocket": AllowedHostsOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns))),
})
