"""The Apertus 1.5 chat format: template, injection-safe tokenization, output parsing."""

from .parse import ParsedOutput, StreamingParser, ToolCall, ToolCallError, parse_output
from .template import VARIANTS, ChatFormatError, compile_template, jinja_template, normalize_messages, render
from .tokenize import ROLES, ChatTokenizer, Encoded, MediaItem

__all__ = ["VARIANTS", "ROLES", "ChatFormatError", "ChatTokenizer", "Encoded", "MediaItem", "compile_template", "jinja_template",
           "normalize_messages", "render", "ParsedOutput", "StreamingParser", "ToolCall", "ToolCallError",
           "parse_output"]
