"""Optimizers of the Apertus training recipe (SPEC.md section 6), as plain ``torch.optim`` classes.

Import a submodule (``apertus_plugins.optim.ademamix``) only where torch is installed.
"""
