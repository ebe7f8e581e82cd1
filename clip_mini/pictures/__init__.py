"""Pictures: result grids, attention overlays and training curves."""
