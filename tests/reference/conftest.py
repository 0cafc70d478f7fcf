"""Reference suite fixtures: test this working tree, whatever checkout the environment was built from."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
for name in [m for m in sys.modules if m == "apertus_plugins" or m.startswith("apertus_plugins.")]:
    if not str(getattr(sys.modules[name], "__file__", "") or "").startswith(str(ROOT)):
        del sys.modules[name]


@pytest.fixture(scope="session")
def full_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from apertus_plugins.core.vocab import VocabSpec
    from apertus_plugins.testing.tokenizer_builder import build_test_tokenizer

    return build_test_tokenizer(tmp_path_factory.mktemp("tok_full"), VocabSpec())
