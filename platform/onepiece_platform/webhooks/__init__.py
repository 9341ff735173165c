"""Completion webhooks: clients' endpoints, the outbox of deliveries and the worker that sends them."""
