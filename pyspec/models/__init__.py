"""Model layer: checkpoint conversion, loading and the default embedded model."""
