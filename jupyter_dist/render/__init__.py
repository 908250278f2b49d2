"""Layer `render` (see docs/architecture.md)."""
