"""Apertus 1.5 as a text-only causal LM in ``transformers`` terms, over a released checkpoint.

:class:`Apertus1p5ForCausalLM` reads a released Apertus 1.5 checkpoint (SPEC.md section 5) as it
is: ``config.json`` of model type ``apertus1p5`` (the classes of :mod:`apertus_plugins.hf.configs`),
the decoder under ``model.language_model.*``, whose input embedding covers the whole vocabulary
(text, image and audio codes), and ``lm_head.weight`` with the text rows only
(``text_config.output_vocab_size``). The decoder is ``transformers``' own
:class:`~transformers.models.apertus.modeling_apertus.ApertusModel` (xIELU, QK-norm, llama3 RoPE),
built on the checkpoint's ``text_config``; the logits have the head's width, as in the released port.

The vision and audio tokenizers (``model.vision_tokenizer.*``, ``model.audio_tokenizer.*``) are
ignored on load and are no part of the state dict: a text-only post-training stage (SFT, DPO,
RLVR, SDPO) trains the decoder and head, and the names of what it saves or sends to a vLLM
rollout are exactly the checkpoint's (``model.language_model.*``, ``lm_head.weight``).

:func:`register` adds the class to ``AutoModelForCausalLM`` and ``AutoModelForImageTextToText`` for
the ``apertus1p5`` config, where the installed ``transformers`` has no model of that type (those
before the released port, 5.24); the verl adapter calls it in every verl process. verl picks
``AutoModelForImageTextToText`` for a config whose type that class maps (its FSDP engine's
``get_hf_auto_model_class``) and for the architecture ``...ForConditionalGeneration`` (its
checkpoint manager and model merger), so the released checkpoint's own ``config.json`` leads verl
to this class; ``AutoModelForCausalLM`` serves code that asks for a causal LM by name. With the
released port installed, its own classes stay (the multimodal model).
"""

from __future__ import annotations

import re

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.apertus.modeling_apertus import ApertusModel

from apertus_plugins.core.tensor_names import ENCODER_PREFIXES

from .configs import Apertus1p5Config
from .configs import register as register_configs

__all__ = ["ENCODER_PREFIXES", "Apertus1p5ForCausalLM", "register"]

class Apertus1p5LanguageModelHolder(nn.Module):
    """The ``model`` module of the released layout, holding only its ``language_model`` (the decoder)."""

    def __init__(self, language_model: ApertusModel) -> None:
        super().__init__()
        self.language_model = language_model


class Apertus1p5ForCausalLM(PreTrainedModel, GenerationMixin):
    """The Apertus 1.5 decoder and its text head, named as in the released checkpoint; no media encoders.

    ``logits`` have ``text_config.output_vocab_size`` columns (the head's rows, the text ids), as the
    released ``Apertus1p5ForConditionalGeneration`` returns them; the input embedding takes every id of
    the vocabulary.
    """

    config_class = Apertus1p5Config
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["ApertusDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _keys_to_ignore_on_load_unexpected = ["^" + re.escape(p) for p in ENCODER_PREFIXES]

    def __init__(self, config: Apertus1p5Config) -> None:
        super().__init__(config)
        text = config.text_config
        self.vocab_size = text.vocab_size
        self.output_vocab_size = text.output_vocab_size or text.vocab_size
        self.model = Apertus1p5LanguageModelHolder(ApertusModel(text))
        self.lm_head = nn.Linear(text.hidden_size, self.output_vocab_size, bias=False)
        self.post_init()

    @property
    def language_model(self) -> ApertusModel:
        """The decoder (``model.language_model``)."""
        return self.model.language_model

    def get_input_embeddings(self) -> nn.Module:
        return self.model.language_model.embed_tokens

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.language_model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Module) -> None:
        self.lm_head = value

    def get_decoder(self) -> ApertusModel:
        return self.model.language_model

    def _init_weights(self, module: nn.Module) -> None:
        # the decoder initialises its own modules; the head here (normal, the text config's range)
        if module is self.lm_head:
            nn.init.normal_(module.weight, mean=0.0, std=self.config.text_config.initializer_range)
        else:
            super()._init_weights(module)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: object | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: object,
    ) -> CausalLMOutputWithPast:
        """Logits over the text ids; ``labels`` (text ids or -100) give the shifted cross-entropy ``loss``."""
        outputs = self.model.language_model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden[:, keep, :])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.output_vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=outputs.past_key_values,
                                      hidden_states=outputs.hidden_states, attentions=outputs.attentions)


def register() -> list[str]:
    """Register the configs and this class with ``transformers``' Auto classes where they lack ``apertus1p5``.

    Returns what was added (``"AutoConfig:<type>"``, ``"AutoModelForCausalLM"``, ``"AutoModelForImageTextToText"``).
    Idempotent. A ``transformers`` with the released port (5.24 and later) keeps its own classes.
    """
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    added = [f"AutoConfig:{t}" for t in register_configs()]
    if CONFIG_MAPPING[Apertus1p5Config.model_type] is not Apertus1p5Config:
        return added  # the installed transformers has the released port
    for auto in (AutoModelForCausalLM, AutoModelForImageTextToText):
        if Apertus1p5Config in auto._model_mapping:
            continue
        auto.register(Apertus1p5Config, Apertus1p5ForCausalLM)
        added.append(auto.__name__)
    return added
