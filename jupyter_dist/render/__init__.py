"""Layer `render` (see ARCHITECTURE.md)."""
