"""apertus-plugins core: the Apertus 1.5 facts, framework-free.

Submodules: :mod:`vocab` (the id layout), :mod:`media` (images and audio as token sequences),
:mod:`chat` (the chat format, tokenization, output parsing), :mod:`plugins` (the plugin manager).
"""

__version__ = "0.1.0"
