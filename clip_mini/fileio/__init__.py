"""File helpers: atomic writes, bounded reads, checksums and the model-directory manifest."""
