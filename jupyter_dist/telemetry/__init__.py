"""Layer `telemetry` (see docs/architecture.md)."""
