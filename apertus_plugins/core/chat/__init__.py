"""The Apertus 1.5 chat format: template, injection-safe tokenization, output parsing."""

from .parse import ParsedOutput, StreamingParser, ToolCall, ToolCallError, parse_output, read_output, visible_answer
from .template import (
    VARIANTS,
    ChatFormatError,
    compile_template,
    jinja_template,
    normalize_messages,
    reasoning_as_blocks,
    render,
)
from .tokenize import ROLES, ChatTokenizer, Encoded, MediaItem, injection_literals

__all__ = ["VARIANTS", "ROLES", "ChatFormatError", "ChatTokenizer", "Encoded", "MediaItem", "compile_template",
           "injection_literals", "jinja_template", "normalize_messages", "reasoning_as_blocks", "render",
           "ParsedOutput", "StreamingParser", "ToolCall", "ToolCallError", "parse_output", "read_output",
           "visible_answer"]
