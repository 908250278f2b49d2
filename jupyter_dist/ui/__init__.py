"""Layer `ui` (see ARCHITECTURE.md)."""
