"""The Hub ids of the Apertus 1.5 release, and the other spelling users meet: the one place the tree names them.

The weights are published by the ``swiss-ai`` organisation on the Hugging Face Hub. The public record:
the transformers pull request that adds the model (huggingface/transformers#47662) says "We released the two
final checkpoints: swiss-ai/Apertus-v1.5-8B and swiss-ai/Apertus-v1.5-70B", with the intermediate
checkpoints to follow with the technical report; SGLang's port (sgl-project/sglang#32979) registers
``swiss-ai/Apertus-v1.5-8B`` for its model tests; the Apertus project's vLLM guide sets
``HF_MODEL`` to ``swiss-ai/Apertus-v1.5-8B``; the release team's launch catalogue review asks to "take the
official image from HF https://huggingface.co/swiss-ai/Apertus-v1.5-8B" (swiss-ai/model-launch#210).
``apertus-ai/Apertus-v1.5-8B`` / ``-70B`` is the spelling of vLLM's Apertus 1.5 pull request
(vllm-project/vllm#50496, "hf tags apertus-ai/...") and of served model names; it is kept as an alias:
:func:`other_spellings` maps one to the other, so a checkpoint in the Hugging Face cache under either
spelling is found under both (:func:`apertus_plugins.infra.hub.local_path`), and :func:`canonical` turns
either into the id that downloads.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "ALIAS_ORG", "CHECKPOINTS", "HUB_ORG", "MODELS", "MODEL_8B", "MODEL_8B_BASE", "MODEL_70B", "MODEL_70B_BASE",
    "MODEL_70B_SFT", "TOKENIZER_REPO", "TOKENIZER_URL", "Checkpoint", "canonical", "checkpoint", "other_spellings",
]

#: The organisation that publishes the release's weights on the Hugging Face Hub.
HUB_ORG = "swiss-ai"
#: The other organisation the same models are named under (vLLM's pull request, served model names).
ALIAS_ORG = "apertus-ai"
#: The family of released model repositories (the post-trained models and their stages).
_FAMILY = "Apertus-v1.5-"

#: The two final, post-trained checkpoints (text, images, audio; chat, tools, thinking).
MODEL_8B = f"{HUB_ORG}/{_FAMILY}8B"
MODEL_70B = f"{HUB_ORG}/{_FAMILY}70B"
MODELS = (MODEL_8B, MODEL_70B)
#: The continued-pretraining (base) checkpoints, before any post-training.
MODEL_8B_BASE = f"{MODEL_8B}-base"
MODEL_70B_BASE = f"{MODEL_70B}-base"
#: The supervised fine-tuning stage of the 70B, before preference alignment.
MODEL_70B_SFT = f"{MODEL_70B}-SFT"

#: The tokenizer repository (GitHub, not the Hub): the canonical tokenizer, chat template and checksums.
TOKENIZER_REPO = "swiss-ai/apertus-omni-tokenizer"
TOKENIZER_URL = f"https://github.com/{TOKENIZER_REPO}"


@dataclass(frozen=True)
class Checkpoint:
    """One published checkpoint of the release: its Hub id, size, training stage and what it is for."""

    repo_id: str
    size: str
    stage: str
    use: str


#: Every published checkpoint of the release known by id, final models first.
CHECKPOINTS: tuple[Checkpoint, ...] = (
    Checkpoint(MODEL_8B, "8B", "final", "serving and evaluation of the chat model (tools, thinking, images, "
               "audio); the starting point for LoRA and further post-training"),
    Checkpoint(MODEL_70B, "70B", "final", "serving (tensor parallel 4 in the release's launches); the target "
               "for speculative decoding with the 8B as drafter"),
    Checkpoint(MODEL_8B_BASE, "8B", "base", "continued pretraining and the base-model evaluation suite "
               "(no chat template applied)"),
    Checkpoint(MODEL_70B_BASE, "70B", "base", "continued pretraining and the base-model evaluation suite "
               "(no chat template applied)"),
    Checkpoint(MODEL_70B_SFT, "70B", "sft", "a starting point for RL and preference alignment (the stage before "
               "the final model's alignment)"),
)

_ORGS = (HUB_ORG, ALIAS_ORG)


def checkpoint(repo_id: str) -> Checkpoint | None:
    """The published checkpoint ``repo_id`` names under either spelling (a revision ``@REV`` is ignored), else None."""
    want = canonical(repo_id.partition("@")[0]).lower()
    return next((c for c in CHECKPOINTS if c.repo_id.lower() == want), None)


def _split(repo_id: str) -> tuple[str, str] | None:
    org, sep, name = repo_id.partition("/")
    if not sep or org.lower() not in _ORGS or not name.lower().startswith(_FAMILY.lower()):
        return None
    return org.lower(), name


def other_spellings(repo_id: str) -> tuple[str, ...]:
    """The same released repository under the other organisation (empty for any other id).

    ``apertus-ai/Apertus-v1.5-8B`` -> ``("swiss-ai/Apertus-v1.5-8B",)`` and back; the name (and a
    variant suffix such as ``-70B-base``) is kept as given.
    """
    parts = _split(repo_id)
    if parts is None:
        return ()
    org, name = parts
    return tuple(f"{o}/{name}" for o in _ORGS if o != org)


def canonical(repo_id: str) -> str:
    """The id under the publishing organisation (:data:`HUB_ORG`) for a released repository, else ``repo_id``."""
    parts = _split(repo_id)
    return repo_id if parts is None else f"{HUB_ORG}/{parts[1]}"
