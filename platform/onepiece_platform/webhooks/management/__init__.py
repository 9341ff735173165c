"""Management commands of the webhooks app (the package Django looks in)."""
