"""Operational endpoints: liveness, readiness."""
