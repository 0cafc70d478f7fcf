"""verl adapter of apertus-plugins: SDPO, online and offline DPO, RLVR presets, rewards, judges.

Loaded in every verl process through the ``verl.plugins`` entry point (:mod:`verl_ext.plugin`);
configs ship in ``verl_ext/config`` (``--config-path=pkg://verl_ext/config``). Supports verl 0.9.x.
"""
