"""Adapter package (filled by a later release)."""
