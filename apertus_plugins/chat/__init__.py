"""The Apertus 1.5 chat format: template, rendering."""

from .template import VARIANTS, ChatFormatError, jinja_template, normalize_messages, render

__all__ = ["VARIANTS", "ChatFormatError", "jinja_template", "normalize_messages", "render"]
