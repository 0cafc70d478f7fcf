"""Hydra configs of the Apertus stages (``--config-path=pkg://verl_ext/config``)."""
