"""The package version, one place: library code reads it here, never from ``fasttorch``."""

__version__ = "0.1.0"
