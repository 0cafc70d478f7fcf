"""Data applications built on the core: offline tokenization (``offline``), the Megatron indexed-dataset
format (``indexed``), dataset manifests (``manifest``)."""
