"""Layer `launch` (see ARCHITECTURE.md)."""
