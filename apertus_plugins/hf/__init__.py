"""Apertus 1.5 in ``transformers`` terms, for frameworks whose ``transformers`` predates the released port.

- :mod:`apertus_plugins.hf.configs`: the config classes (``transformers`` only, no torch);
- :mod:`apertus_plugins.hf.modeling`: :class:`~apertus_plugins.hf.modeling.Apertus1p5ForCausalLM`, the
  text-only causal LM over a released checkpoint (needs torch).

Nothing is imported here: import the submodule you need.
"""
