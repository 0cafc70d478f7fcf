"""Task folder (YAMLs + utils.py)."""
