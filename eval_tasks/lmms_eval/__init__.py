"""lmms-eval task folder (``--include_path``): upstream tasks under ``apertus_`` names."""
