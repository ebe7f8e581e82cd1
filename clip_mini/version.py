"""The package version, in a leaf module: the model writer records it without importing the package's API."""
__version__ = "0.1.0"
