"""The Proxy: request intake, UIDs, Request Monitor (admission control); see app.py."""
