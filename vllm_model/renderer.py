"""The chat path of Apertus 1.5 in vLLM: a conversation becomes the core's injection-safe ids.

vLLM's stock chat path renders a request with the checkpoint's chat template and tokenizes the
whole string, so user text holding ``<|system_start|>``, ``<|assistant_end|>`` or ``<|image|>``
turns into those special ids (a forged system block, a forged turn, a media slot). This renderer
keeps vLLM's own request parsing (OpenAI content parts, media loading, tool-call arguments,
``chat_template_kwargs``) and replaces the template-and-tokenize step with
:meth:`apertus_plugins.core.chat.ChatTokenizer.encode_conversation`: the template's structure tokens
become ids, every string of the request is encoded as plain text. The ids are exactly the core's
for the same request; the prompt text vLLM reports is the rendered template string.

It serves every path that renders a conversation in vLLM (``/v1/chat/completions``, streamed or
not, ``/tokenize`` with ``messages``, the Responses and Anthropic APIs), registered as vLLM's
tokenizer and renderer mode ``apertus`` (``vllm.renderers.registry.RENDERER_REGISTRY``, vLLM's
extension point for chat renderers). The model's config hook
(:class:`vllm_model.generation.Apertus1p5GenerationDefaults`) selects the mode for an Apertus 1.5
checkpoint when ``--tokenizer-mode`` is ``auto``; ``--tokenizer-mode hf`` gives vLLM's stock path
back (not injection-safe: ``apertus doctor --serve`` fails ``serve.injection`` there). Completion
requests with a raw prompt (``/v1/completions``) are tokenized as vLLM always does: the caller owns
that whole prompt.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

from vllm.renderers.chat_utils import parse_chat_messages, parse_chat_messages_async
from vllm.renderers.hf import HfRenderer, resolve_chat_template
from vllm.utils.async_utils import make_async

from apertus_plugins.core.chat import ChatFormatError, ChatTokenizer
from apertus_plugins.core.vocab import VocabSpec

__all__ = ["Apertus1p5Renderer"]


class Apertus1p5Renderer(HfRenderer):
    """vLLM's Hugging Face renderer with the template-and-tokenize step of the core."""

    def __init__(self, config: Any, tokenizer: Any) -> None:
        super().__init__(config, tokenizer)
        self._encode_async = make_async(self._encode, executor=self._executor)

    @cached_property
    def chat_tokenizer(self) -> ChatTokenizer:
        from .processing import _tokenizer_dir

        folder = _tokenizer_dir(self.model_config.tokenizer)
        return ChatTokenizer(self.get_tokenizer().backend_tokenizer, VocabSpec.from_tokenizer_dir(folder))

    def _encode(self, conversation: list[dict[str, Any]], params: Any) -> dict[str, Any]:
        kwargs = params.get_apply_chat_template_kwargs()
        tools = kwargs.get("tools")
        template = resolve_chat_template(self.get_tokenizer(), kwargs.get("chat_template"), tools,
                                         model_config=self.model_config)
        try:
            enc = self.chat_tokenizer.encode_conversation(
                conversation,
                tools=tools,
                add_generation_prompt=bool(kwargs.get("add_generation_prompt", True)),
                enable_thinking=bool(kwargs.get("enable_thinking", False)),
                continue_assistant_message=bool(kwargs.get("continue_final_message", False)),
                template=template,
            )
        except ChatFormatError as exc:  # vLLM answers a ValueError with a 400 naming the problem
            raise ValueError(f"Apertus 1.5 chat format: {exc}") from exc
        return {"prompt_token_ids": enc.ids.tolist(), "prompt": enc.text}

    @staticmethod
    def _attach(prompt: dict[str, Any], mm_data: Any, mm_uuids: Any) -> dict[str, Any]:
        if mm_data is not None:
            prompt["multi_modal_data"] = mm_data
        if mm_uuids is not None:
            prompt["multi_modal_uuids"] = mm_uuids
        return prompt

    def render_messages(self, messages: list[Any], params: Any) -> tuple[list[Any], dict[str, Any]]:
        conversation, mm_data, mm_uuids = parse_chat_messages(
            messages, self.model_config, content_format="openai",
            media_io_kwargs=params.media_io_kwargs, mm_processor_kwargs=params.mm_processor_kwargs)
        return conversation, self._attach(self._encode(conversation, params), mm_data, mm_uuids)

    async def render_messages_async(self, messages: list[Any], params: Any) -> tuple[list[Any], dict[str, Any]]:
        conversation, mm_data, mm_uuids = await parse_chat_messages_async(
            messages, self.model_config, content_format="openai",
            media_io_kwargs=params.media_io_kwargs, mm_processor_kwargs=params.mm_processor_kwargs)
        prompt = await self._render_with_timeout(self._encode_async(conversation, params))
        return conversation, self._attach(prompt, mm_data, mm_uuids)
