"""The Hub ids of the Apertus 1.5 release, and the other spelling users meet: the one place the tree names them.

The release is published by the ``apertus-ai`` organisation on the Hugging Face Hub: the README of the
tokenizer repository (``swiss-ai/apertus-omni-tokenizer`` on GitHub) names
``apertus-ai/Apertus-v1.5-8B`` as the release its canonical tokenizer is built for, vLLM's pull request for
the model names ``apertus-ai/Apertus-v1.5-8B`` and ``apertus-ai/Apertus-v1.5-70B`` as the Hub tags, and
the release launch configurations load those ids. Public deployments (and transformers' docstrings) spell
the same models ``swiss-ai/Apertus-v1.5-8B`` / ``-70B``, the organisation that publishes the report's code
and Apertus 1: :func:`other_spellings` maps one to the other, so a checkpoint in the Hugging Face cache
under either spelling is found under both (:func:`apertus_plugins.infra.hub.local_path`).
"""

from __future__ import annotations

__all__ = [
    "ALIAS_ORG", "HUB_ORG", "MODELS", "MODEL_8B", "MODEL_70B", "TOKENIZER_REPO", "TOKENIZER_URL", "canonical",
    "other_spellings",
]

#: The organisation that publishes the release on the Hugging Face Hub.
HUB_ORG = "apertus-ai"
#: The other organisation the same models are named under (deployments, upstream docstrings).
ALIAS_ORG = "swiss-ai"
#: The family of released model repositories (the post-trained models and their variants).
_FAMILY = "Apertus-v1.5-"

MODEL_8B = f"{HUB_ORG}/{_FAMILY}8B"
MODEL_70B = f"{HUB_ORG}/{_FAMILY}70B"
MODELS = (MODEL_8B, MODEL_70B)

#: The tokenizer repository (GitHub, not the Hub): the canonical tokenizer, chat template and checksums.
TOKENIZER_REPO = "swiss-ai/apertus-omni-tokenizer"
TOKENIZER_URL = f"https://github.com/{TOKENIZER_REPO}"

_ORGS = (HUB_ORG, ALIAS_ORG)


def _split(repo_id: str) -> tuple[str, str] | None:
    org, sep, name = repo_id.partition("/")
    if not sep or org.lower() not in _ORGS or not name.lower().startswith(_FAMILY.lower()):
        return None
    return org.lower(), name


def other_spellings(repo_id: str) -> tuple[str, ...]:
    """The same released repository under the other organisation (empty for any other id).

    ``swiss-ai/Apertus-v1.5-8B`` -> ``("apertus-ai/Apertus-v1.5-8B",)`` and back; the name (and a
    variant suffix such as ``-70B``) is kept as given.
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
