"""lm-eval task folder (``--include_path``): YAMLs with a ``utils.py`` beside each."""
