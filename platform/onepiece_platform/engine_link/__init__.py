"""The platform's link to the engine: its clients (Proxy HTTP, in-process), the reconciler of engine events,
operators' cluster actions."""
