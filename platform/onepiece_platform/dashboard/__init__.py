"""The operators' dashboard: live cluster state over websockets (pages: frontend/)."""
