"""Shared fixtures of the core suite."""

from __future__ import annotations

from pathlib import Path

import pytest

from apertus_plugins.core.vocab import VocabSpec
from apertus_plugins.testing.tokenizer_builder import build_test_tokenizer


@pytest.fixture(scope="session")
def small_spec() -> VocabSpec:
    return VocabSpec.scaled()


@pytest.fixture(scope="session")
def small_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory, small_spec: VocabSpec) -> Path:
    return build_test_tokenizer(tmp_path_factory.mktemp("tok_small"), small_spec, with_templates=False)


@pytest.fixture(scope="session")
def full_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_test_tokenizer(tmp_path_factory.mktemp("tok_full"), VocabSpec(), with_templates=False)
