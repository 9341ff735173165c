"""The webhooks app's commands: deliver_webhooks (the delivery worker)."""
