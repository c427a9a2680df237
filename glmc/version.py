"""The package version (its own module so that any layer may read it without importing glmc)."""
__version__ = "0.1.0"
