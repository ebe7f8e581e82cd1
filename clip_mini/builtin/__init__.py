"""Built-in models: trained deltas shipped with the package over towers from PyPI packages."""
