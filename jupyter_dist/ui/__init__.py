"""Layer `ui` (see docs/architecture.md)."""
