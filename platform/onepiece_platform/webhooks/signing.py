"""Standard Webhooks signatures (https://www.standardwebhooks.com), as ``openai``'s
``client.webhooks.unwrap`` and the ``standardwebhooks`` package verify them.

  secret             ``whsec_`` + base64 of 32 random bytes
  webhook-id         the delivery's ``msg_...`` id, the same on every attempt
  webhook-timestamp  unix seconds of this attempt (receivers refuse one older than 5 minutes, so each
                     retry is signed anew)
  webhook-signature  ``v1,`` + base64(HMAC-SHA256(key = the secret's bytes, "{id}.{timestamp}.{body}"))
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets

PREFIX = "whsec_"


def new_secret() -> str:
    return PREFIX + base64.b64encode(secrets.token_bytes(32)).decode()


def hint(secret: str) -> str:
    """Enough of a secret to tell two apart, not enough to use it."""
    return f"{secret[: len(PREFIX) + 4]}..." if secret else ""


def _key(secret: str) -> bytes:
    return base64.b64decode(secret[len(PREFIX):] if secret.startswith(PREFIX) else secret)


def signature(secret: str, msg_id: str, timestamp: int, body: str) -> str:
    mac = hmac.new(_key(secret), f"{msg_id}.{timestamp}.{body}".encode(), hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


def headers(secret: str, msg_id: str, timestamp: int, body: str) -> dict[str, str]:
    return {"webhook-id": msg_id, "webhook-timestamp": str(timestamp),
            "webhook-signature": signature(secret, msg_id, timestamp, body)}
