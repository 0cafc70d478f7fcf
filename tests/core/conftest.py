"""The core suite's fixtures come from the ``apertus`` pytest plugin (``apertus_plugins.testing.pytest_plugin``,
loaded through the package's ``pytest11`` entry point): ``apertus_small_spec``, ``apertus_tokenizer_dir``,
``apertus_full_tokenizer_dir`` and the rest."""
