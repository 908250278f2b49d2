"""Layer `worker` (see ARCHITECTURE.md)."""
