"""The Apertus 1.5 facts, framework-free: the id layout, media sequences, the chat format, loss targets.

numpy only (``losses`` and ``xielu`` hold torch math and import torch themselves); no framework, no plugin
registry, no I/O beyond what a function is handed.
"""
