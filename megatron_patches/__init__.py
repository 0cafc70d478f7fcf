"""The Megatron adapter: Apertus 1.5 in upstream Megatron-LM / megatron-core, through their extension points.

* ``apertus-megatron pretrain_gpt.py <Megatron flags> --apertus-...`` (:mod:`megatron_patches.launcher`)
  runs the user's upstream script unchanged with the plugin active.
* :mod:`megatron_patches.arguments`: the ``--apertus-*`` argument group (an ``extra_args_provider``).
* :mod:`megatron_patches.spec`: the Apertus layer as a megatron-core layer spec (xIELU MLP).
* :mod:`megatron_patches.dataset`: pretraining and SFT samples over indexed datasets, built by
  megatron-core's ``BlendedMegatronDatasetBuilder``.
* :mod:`megatron_patches.training`: the batch, the forward step and the loss function.
* :mod:`megatron_patches.optimizer`: AdEMAMix inside megatron-core's optimizer wrappers.
* :mod:`megatron_patches.checkpoint`: Megatron's distributed checkpoints for ``apertus convert``.
* :mod:`megatron_patches.recipes`: the SPEC.md section 6 stages as flags (``--apertus-recipe NAME``).

Importing this package imports no Megatron code; each submodule checks the installed
megatron-core version (:mod:`megatron_patches.version`) before it imports any.
"""
