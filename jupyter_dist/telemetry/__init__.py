"""Layer `telemetry` (see ARCHITECTURE.md)."""
