"""apertus-plugins: Apertus 1.5 for vLLM, Megatron, verl, lm-eval and lmms-eval, over one framework-free core.

The package in tiers, each importing only the tiers below it (``ARCHITECTURE.md``):

- :mod:`apertus_plugins.core`: the Apertus 1.5 facts (id layout, media sequences, chat format, loss targets)
- :mod:`apertus_plugins.infra`: Hub ids, the HTTP client, the upstream version gate
- :mod:`apertus_plugins.encoders`: the IBQ vision and WavTokenizer audio encoders (torch)
- :mod:`apertus_plugins.plugins`: the plugin hooks and the registry over the core
- :mod:`apertus_plugins.data`: offline tokenization, the indexed-dataset format, manifests
- :mod:`apertus_plugins.posttrain`: judges, rewards, evaluation helpers
- :mod:`apertus_plugins.hf`, :mod:`apertus_plugins.doctor`, :mod:`apertus_plugins.cli`: transformers classes,
  the release checks, the ``apertus`` command
- :mod:`apertus_plugins.testing`: random checkpoints, the test tokenizer, the server launcher (tests and demos)
"""

__version__ = "0.1.0"
