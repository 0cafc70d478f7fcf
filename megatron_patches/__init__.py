"""The Megatron adapter: Apertus 1.5 in upstream Megatron-LM / megatron-core, through their extension points.

* ``apertus-megatron pretrain_gpt.py <Megatron flags> --apertus-...`` (:mod:`megatron_patches.launcher`)
  runs the user's upstream script unchanged with the plugin active.
* :mod:`megatron_patches.arguments`: the ``--apertus-*`` argument group (an ``extra_args_provider``).
* :mod:`megatron_patches.spec`: the Apertus layer as a megatron-core layer spec (xIELU MLP).
* :mod:`megatron_patches.model_builder`: the Apertus model as a Megatron-LM 0.19 model config.
* :mod:`megatron_patches.dataset`: pretraining and SFT samples over indexed datasets, built by
  megatron-core's ``BlendedMegatronDatasetBuilder``.
* :mod:`megatron_patches.training`: the batch, the forward step and the loss function, the model
  and dataset providers, the preflight.
* :mod:`megatron_patches.optimizer`: AdEMAMix and the weight-decay rule in megatron-core's form.
* :mod:`megatron_patches.overrides`: every Megatron function the adapter wraps (where Megatron has
  no hook), with the versions each was checked on.
* :mod:`megatron_patches.checkpoint`: Megatron's distributed checkpoints for ``apertus convert``.
* :mod:`megatron_patches.recipes`: the SPEC.md section 6 stages as flags (``--apertus-recipe NAME``).

Importing this package imports no Megatron code. The launcher, the arguments, the recipes, the
overrides and the conversion math import Megatron inside their functions only (they run before the
installed megatron-core is checked, or without it); each module that imports Megatron at its top
checks the installed megatron-core version (:mod:`megatron_patches.version`) right after its imports.
"""
