"""Device and process telemetry (NVML where present, CPU figures otherwise), Prometheus metrics."""
