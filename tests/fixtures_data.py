"""Fixtures for real image data (owned by the data area)."""
