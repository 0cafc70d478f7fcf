"""Task folder (YAML + utils.py)."""
