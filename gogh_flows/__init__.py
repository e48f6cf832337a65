"""gogh-flows."""
