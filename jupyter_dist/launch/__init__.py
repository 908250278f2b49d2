"""Layer `launch` (see docs/architecture.md)."""
