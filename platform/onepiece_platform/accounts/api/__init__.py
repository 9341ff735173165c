"""The accounts app's REST API: API keys listed, created and revoked by their owner."""
