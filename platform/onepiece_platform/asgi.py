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

from onepiece_platform.ops.checks import refuse_weak_secrets  # noqa: E402 - needs the settings loaded

refuse_weak_secrets()  # production with a placeholder SECRET_KEY: refuse to serve at all

from django.conf import settings  # noqa: E402

from engine import envs  # noqa: E402
from onepiece_platform.ops.bodylimit import BodyLimit  # noqa: E402
from onepiece_platform.ops.origin import SameOriginValidator  # noqa: E402
from onepiece_platform.routing import websocket_urlpatterns  # noqa: E402 - needs the apps loaded

application = ProtocolTypeRouter({
    # bodies are counted as they stream (a chunked body has no Content-Length for Django to check)
    # ...and must arrive within ONEPIECE_BODY_TIMEOUT_S (a trickling client is answered 408)
    "http": BodyLimit(django_asgi_app, settings.DATA_UPLOAD_MAX_MEMORY_SIZE, envs.BODY_TIMEOUT_S),
    # the Origin's host in ALLOWED_HOSTS, and its host and port those of the socket (ops/origin.py)
    "websocket": SameOriginValidator(
        AllowedHostsOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns)))),
})
