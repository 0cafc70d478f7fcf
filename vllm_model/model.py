"""Apertus 1.5 in vLLM: vLLM's own Apertus decoder reading image and audio codes.

The released checkpoint (SPEC.md section 5): ``model.language_model.*`` is an Apertus decoder
(xIELU, QK-norm, RoPE scaling from the config) whose input embedding covers the whole 1.5
vocabulary (266,752 rows), ``lm_head`` keeps the text rows only (``output_vocab_size``), and
``model.vision_tokenizer.*`` / ``model.audio_tokenizer.*`` are the IBQ and WavTokenizer encoders,
kept in float32. The decoder is :class:`vllm.model_executor.models.apertus.ApertusModel`
unchanged; this class adds the tokenizers, embeds their codes with the decoder's own embedding
(:meth:`embed_multimodal`) and merges them at the placeholder positions (the
``SupportsMultiModal`` path through :meth:`get_language_model`).

The tokenizers are the core's :class:`~apertus_plugins.encoders.VisionTokenizer` and
:class:`~apertus_plugins.encoders.AudioTokenizer`, built from the checkpoint's ``vision_config`` and
``audio_config`` and loaded by vLLM's weight loader like every other module; they run in float32
(their code selection is an argmax over the codebook) whatever the serving dtype, on items batched
by exact shape (:func:`~apertus_plugins.encoders.group_by_shape`; never padded).

Debugging: with ``APERTUS_VLLM_CODES_LOG=FILE`` in the server's environment, every item that
:meth:`embed_multimodal` embeds appends one JSON line ``{"modality", "shape", "seconds", "codes"}`` to FILE
(codebook indices without the vocabulary offset; ``seconds``: the encoder time of the item's batch
divided by its size, measured only while logging; with the media-code cache on, only the items
the encoders ran on are logged).

The persistent media-code cache (:mod:`apertus_plugins.encoders.cache`): with
``APERTUS_MEDIA_CACHE=DIR`` in the server's environment, :meth:`embed_multimodal` looks every item up
by its content and the encoder's weights, encodes only the misses (batched by shape) and stores
them, so a picture served before (by this server, another one or ``apertus tokenize``) costs no
encoder time. Hits and misses are logged every :data:`CACHE_LOG_EVERY` items.

EAGLE-3 (``--speculative-config '{"model": HEAD, "num_speculative_tokens": 3}'`` with a head in the
``speculators`` format, or ``"method": "eagle3"``): the decoder hands out the hidden states of the
auxiliary layers the head's config names (``eagle_aux_hidden_state_layer_ids``; else vLLM's default
``(2, L // 2, L - 3)``), and the head drafts with the target's embedding (the whole vocabulary) and,
where it has none of its own, the target's text head. A head whose vocabulary, hidden size or layers do not
fit the served checkpoint is refused when the server starts (:func:`check_eagle3_head`).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable

import numpy as np
import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.activation import XIELU
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.apertus import ApertusModel
from vllm.model_executor.models.interfaces import (
    MultiModalEmbeddings,
    SupportsEagle3,
    SupportsLoRA,
    SupportsMultiModal,
    SupportsPP,
)
from vllm.model_executor.models.module_mapping import MultiModelKeys
from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper, maybe_prefix
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.sequence import IntermediateTensors

from apertus_plugins.core.tensor_names import AUDIO_PREFIX, EMBEDDING, LANGUAGE_MODEL_PREFIX, LM_HEAD, VISION_PREFIX
from apertus_plugins.encoders import (
    AudioTokenizer,
    AudioTokenizerConfig,
    VisionTokenizer,
    VisionTokenizerConfig,
    group_by_shape,
)
from apertus_plugins.encoders.cache import MediaCodeCache, forget_fingerprint

from .eager import refresh_eager_layers, use_eager_layers
from .logs import get_logger
from .processing import Apertus1p5DummyInputsBuilder, Apertus1p5MultiModalProcessor, Apertus1p5ProcessingInfo

__all__ = ["Apertus1p5ForConditionalGeneration", "CODES_LOG_ENV", "CACHE_LOG_EVERY", "DRAFT_PREFIX",
           "check_eagle3_head", "check_vocabulary"]

logger = get_logger(__name__)  # under vLLM's `vllm` logger: shown by `vllm serve`

#: Environment variable naming a file where the embedded media codes are appended (debugging, parity).
CODES_LOG_ENV = "APERTUS_VLLM_CODES_LOG"
#: With the media-code cache on, its counts are logged each time this many more items were looked up.
CACHE_LOG_EVERY = 100
#: The prefix vLLM's draft-model proposer builds its draft under (``vllm/v1/spec_decode/draft_model.py``).
DRAFT_PREFIX = "draft_model"


def check_eagle3_head(head: object, text_config: object) -> None:
    """Raise ``ValueError`` naming the mismatch unless an EAGLE-3 head's config fits the target's text config.

    The head embeds with the target's embedding (every id of the vocabulary), reads the hidden states
    of ``eagle_aux_hidden_state_layer_ids`` (layer indices of the target; vLLM's default when absent)
    and proposes ids below the target's text vocabulary.
    """
    vocab, hidden = int(text_config.vocab_size), int(text_config.hidden_size)
    layers = int(text_config.num_hidden_layers)
    text_ids = int(getattr(text_config, "output_vocab_size", None) or vocab)
    problems = []
    if int(getattr(head, "vocab_size", vocab)) != vocab:
        problems.append(f"vocab_size {head.vocab_size} != the target's {vocab}")  # type: ignore[attr-defined]
    target_hidden = getattr(head, "target_hidden_size", None) or getattr(head, "hidden_size", hidden)
    if int(target_hidden) != hidden:
        problems.append(f"target_hidden_size {target_hidden} != the target's hidden size {hidden}")
    draft_vocab = getattr(head, "draft_vocab_size", None)
    if draft_vocab is not None and not 0 < int(draft_vocab) <= text_ids:
        problems.append(f"draft_vocab_size {draft_vocab} is not within the target's {text_ids} text ids")
    eagle = getattr(head, "eagle_config", None) or {}
    ids = getattr(head, "eagle_aux_hidden_state_layer_ids", None) or eagle.get("eagle_aux_hidden_state_layer_ids")
    ids = [int(i) for i in ids or ()]
    if any(not 0 <= i <= layers for i in ids) or len(set(ids)) != len(ids):
        # id k is the residual stream after k decoder layers (0: the embeddings); vLLM keeps each id once
        problems.append(f"eagle_aux_hidden_state_layer_ids {ids} are not distinct layers within 0..{layers}")
    if problems:
        raise ValueError("the EAGLE-3 head does not fit this Apertus 1.5 checkpoint: " + "; ".join(problems))


def check_vocabulary(name: str, tensor: torch.Tensor, rows: int, hidden: int) -> None:
    """Raise ``ValueError`` unless a checkpoint's embedding or head tensor has ``rows`` rows (of ``hidden``
    values where it is not packed by a quantization): a quantized or converted checkpoint whose
    vocabulary or layout is not its config's is refused naming the tensor, before any weight is loaded."""
    shape = list(tensor.shape)
    packed = not tensor.is_floating_point()  # int8/fp4 storage may pack several values per element
    if len(shape) != 2 or shape[0] != rows or (not packed and shape[1] != hidden):
        raise ValueError(f"{name} has shape {shape}, the checkpoint's config needs [{rows}, {hidden}] "
                         "(vocabulary x hidden size): the weights do not match the config's vocabulary or layout")


def _config_dict(config: object) -> dict:
    return config.to_dict() if hasattr(config, "to_dict") else dict(config)  # type: ignore[call-overload]


@MULTIMODAL_REGISTRY.register_processor(
    Apertus1p5MultiModalProcessor,
    info=Apertus1p5ProcessingInfo,
    dummy_inputs=Apertus1p5DummyInputsBuilder,
)
class Apertus1p5ForConditionalGeneration(nn.Module, SupportsMultiModal, SupportsPP, SupportsLoRA, SupportsEagle3):
    """Apertus 1.5: text, images and audio as tokens of one vocabulary; logits over text ids.

    LoRA (``vllm serve ... --enable-lora --lora-modules NAME=DIR``): adapters apply to the decoder's
    linear projections (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``up_proj``, ``down_proj``;
    q/k/v packed into ``qkv_proj``) under ``language_model``. An adapter saved by PEFT on the text-only
    :class:`~apertus_plugins.hf.modeling.Apertus1p5ForCausalLM` names them
    ``base_model.model.model.language_model.layers.N...``; :attr:`hf_to_vllm_mapper` renames them to
    this model's modules. The vision and audio tokenizers stay frozen (no LoRA: :meth:`get_mm_mapping`
    names them as towers and tower LoRA is off), and so do the embedding and the text head.
    """

    hf_to_vllm_mapper = WeightsMapper(
        orig_to_new_stacked={
            ".q_proj": (".qkv_proj", "q"),
            ".k_proj": (".qkv_proj", "k"),
            ".v_proj": (".qkv_proj", "v"),
        },
        orig_to_new_prefix={
            LANGUAGE_MODEL_PREFIX: "language_model.",
            VISION_PREFIX: "vision_tokenizer.",
            AUDIO_PREFIX: "audio_tokenizer.",
        },
    )
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    # LoRA on the decoder's linear layers only: the embedding (every vocabulary row) and the text head
    # keep their weights, so no embedding module is adapted
    embedding_modules: dict[str, str] = {}
    # the media tokenizers are frozen: vLLM's tower/connector LoRA stays off for them
    supports_tower_connector_lora = False

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> str | None:
        # the chat template renders the placeholders itself
        return None

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        text_config = config.text_config
        self.config = config
        self.vocab_size = text_config.vocab_size
        self.output_vocab_size = text_config.output_vocab_size or text_config.vocab_size

        # the code selection is an argmax over the codebook: the tokenizers stay in float32
        with self._mark_tower_model(vllm_config, "image"):
            vision = VisionTokenizerConfig.from_dict(_config_dict(config.vision_config), "vision_config")
            self.vision_tokenizer = VisionTokenizer(vision).float()
        with self._mark_tower_model(vllm_config, "audio"):
            audio = AudioTokenizerConfig.from_dict(_config_dict(config.audio_config), "audio_config")
            self.audio_tokenizer = AudioTokenizer(audio).float()

        with self._mark_language_model(vllm_config):
            self.language_model = ApertusModel(vllm_config=vllm_config.with_hf_config(text_config),
                                               prefix=maybe_prefix(prefix, "language_model"))
            # vLLM's Apertus MLP builds xIELU in bfloat16 whatever the serving dtype, which rounds the
            # checkpoint's alphas (about 1e-2 in float32 log-probabilities); the port keeps the model dtype
            for layer in self.language_model.layers:
                if isinstance(getattr(getattr(layer, "mlp", None), "act_fn", None), XIELU):
                    layer.mlp.act_fn = XIELU(dtype=vllm_config.model_config.dtype)
            # eager CPU decoding: leaner RMSNorm/xIELU calls with vLLM's own values (vllm_model.eager)
            if use_eager_layers(self.language_model, vllm_config):
                logger.info("apertus: eager CPU forms of RMSNorm and xIELU in the decoder (vLLM's values)")
            self.lm_head = ParallelLMHead(self.output_vocab_size, text_config.hidden_size,
                                          quant_config=vllm_config.quant_config, prefix=maybe_prefix(prefix, "lm_head"))
            self.logits_processor = LogitsProcessor(self.output_vocab_size)

        self.make_empty_intermediate_tensors = self.language_model.make_empty_intermediate_tensors
        if prefix.split(".")[0] == DRAFT_PREFIX:
            # As the draft of a speculating server, vLLM's draft-model proposer would hand this model the
            # target's placeholder mask for one token fewer than it drafts on (IndexError in
            # _merge_multimodal_embeddings, the engine dies); a draft without media embeddings is given the
            # ids alone (the placeholders' own rows). The target's verification keeps the greedy tokens exact.
            self.supports_multimodal_embeddings = False
            logger.info("apertus: serving as a draft model: media drafted from their placeholder ids")
        speculative = vllm_config.speculative_config
        if speculative is not None and speculative.method in ("eagle", "eagle3") and \
                prefix.split(".")[0] != DRAFT_PREFIX:
            check_eagle3_head(speculative.draft_model_config.hf_config, text_config)
            # vLLM's EAGLE proposers take the target's embedding from get_language_model().model.embed_tokens
            # and its head from get_language_model().lm_head: the decoder lends both (plain attributes, not
            # submodules: the weights stay registered once, where they are)
            object.__setattr__(self.language_model, "model", self.language_model)
            object.__setattr__(self.language_model, "lm_head", self.lm_head)
            logger.info("apertus: EAGLE-3 head %s drafts from the decoder's hidden states",
                        speculative.draft_model_config.model)
        self.media_cache = MediaCodeCache.from_env()  # APERTUS_MEDIA_CACHE; None (off) by default
        self._cache_logged = 0
        if self.media_cache is not None:
            logger.info("apertus: %r on: stored image/audio codes are reused", self.media_cache)

    def get_language_model(self) -> nn.Module:
        return self.language_model

    def get_mm_mapping(self) -> MultiModelKeys:
        """The decoder takes LoRA adapters; the vision and audio tokenizers are towers (frozen)."""
        return MultiModelKeys.from_string_field(language_model="language_model",
                                                tower_model=["vision_tokenizer", "audio_tokenizer"])

    # ------------------------------------------------------------------ media
    @staticmethod
    def _log_codes(path: str, modality: str, codes: list[torch.Tensor], seconds: list[float]) -> None:
        with open(path, "a", encoding="utf-8") as fh:
            for c, sec in zip(codes, seconds, strict=True):
                fh.write(json.dumps({"modality": modality, "shape": list(c.shape), "seconds": sec,
                                     "codes": c.flatten().tolist()}) + "\n")

    def _encode(self, modality: str, items: list[torch.Tensor]) -> list[torch.Tensor]:
        """Codebook indices per item, from the media-code cache where it is on and holds them."""
        tokenizer = self.vision_tokenizer if modality == "image" else self.audio_tokenizer
        cache = self.media_cache
        if cache is None or not items:
            return self._encode_batches(tokenizer, modality, items)
        found = cache.codes(modality, tokenizer, items,
                            lambda todo: self._encode_batches(tokenizer, modality, [items[i] for i in todo]))
        device = next(tokenizer.parameters()).device
        looked = cache.hits + cache.misses
        if looked - self._cache_logged >= CACHE_LOG_EVERY:
            self._cache_logged = looked
            logger.info("apertus: %s", cache.summary())
        return [torch.from_numpy(np.asarray(c)).to(device) for c in found]

    def _encode_batches(self, tokenizer: nn.Module, modality: str, items: list[torch.Tensor]) -> list[torch.Tensor]:
        """Codebook indices per item: items of identical shape share one batch, none is padded."""
        log = os.environ.get(CODES_LOG_ENV)
        codes: list[torch.Tensor | None] = [None] * len(items)
        seconds = [0.0] * len(items)
        for batch in group_by_shape(items):
            start = time.perf_counter()
            out = tokenizer.encode([items[i] for i in batch])  # float32 pixels / samples, as the processor made them
            if log and out.device.type == "cuda":
                torch.cuda.synchronize(out.device)
            elapsed = (time.perf_counter() - start) / len(batch)
            for j, i in enumerate(batch):
                codes[i], seconds[i] = out[j], elapsed
        if log:
            self._log_codes(log, modality, codes, seconds)  # type: ignore[arg-type]
        return codes  # type: ignore[return-value]

    def _embed_codes(self, codes: list[torch.Tensor], offset: int) -> list[torch.Tensor]:
        embed = self.language_model.embed_input_ids
        return [embed((c.flatten() + offset).to(torch.long)) for c in codes]

    @staticmethod
    def _as_list(value: object) -> list[torch.Tensor]:
        if isinstance(value, torch.Tensor):
            return list(value.unbind(0))
        return [v for v in value]  # type: ignore[union-attr]

    def embed_multimodal(self, **kwargs: object) -> MultiModalEmbeddings:
        embeddings: list[torch.Tensor] = []
        if kwargs.get("pixel_values") is not None:
            codes = self._encode("image", self._as_list(kwargs["pixel_values"]))
            embeddings += self._embed_codes(codes, self.config.image_token_offset)
        if kwargs.get("input_values") is not None:
            codes = self._encode("audio", self._as_list(kwargs["input_values"]))
            embeddings += self._embed_codes(codes, self.config.audio_token_offset)
        return embeddings

    # ------------------------------------------------------------------ decoder
    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None, **kwargs: object) -> torch.Tensor | IntermediateTensors:
        if intermediate_tensors is not None:
            inputs_embeds = None
        return self.language_model(input_ids, positions, intermediate_tensors, inputs_embeds=inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = self.logits_processor(self.lm_head, hidden_states)
        if logits is None or self.output_vocab_size == self.vocab_size:
            return logits
        # the head scores text ids only; every other id of the vocabulary is impossible
        return nn.functional.pad(logits, (0, self.vocab_size - logits.shape[-1]), value=float("-inf"))

    def _checked_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        hidden = int(self.config.text_config.hidden_size)
        rows = {EMBEDDING: self.vocab_size, LM_HEAD: self.output_vocab_size}
        for name, tensor in weights:
            if name in rows:
                check_vocabulary(name, tensor, rows[name], hidden)
            yield name, tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loader = AutoWeightsLoader(self)
        loaded = loader.load_weights(self._checked_weights(weights), mapper=self.hf_to_vllm_mapper)
        for tokenizer in (self.vision_tokenizer, self.audio_tokenizer):
            forget_fingerprint(tokenizer)  # the media-code cache keys by the weights now loaded
        refresh_eager_layers(self.language_model)  # xIELU's activated scalars from the loaded alphas
        return loaded

