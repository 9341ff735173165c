"""The webhooks app's REST API: endpoints and their deliveries, by their owner."""
