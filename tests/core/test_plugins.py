"""The plugin manager: built-ins through the hooks, a third-party plugin through its entry point."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from apertus_plugins import plugins
from apertus_plugins.plugins import Modality, build_registry, get_plugin_manager, hookimpl


def test_builtin_modalities_register_through_hooks():
    reg = build_registry(get_plugin_manager(load_entry_points=False))
    assert set(reg.modalities) >= {"image", "audio"}
    assert reg.modalities["image"].placeholder == "image"
    assert reg.modality_for_part("input_audio").name == "audio"
    assert reg.modality_for_part("image_url").name == "image"
    assert reg.modality_for_part("text") is None
    assert "apertus.builtin.modalities" in reg.plugins


def test_duplicate_names_are_an_error_naming_both_plugins():
    class Clash:
        @hookimpl
        def apertus_modalities(self):
            return [Modality("image", 1, "image", (), ("x",), ("l",), lambda *a, **k: None)]

    pm = get_plugin_manager(load_entry_points=False)
    pm.register(Clash(), name="clashing-plugin")
    with pytest.raises(ValueError, match="image.*registered twice.*clashing-plugin"):
        build_registry(pm)


def test_judges_rewards_and_rules_are_collected():
    class Extras:
        @hookimpl
        def apertus_judges(self):
            return {"echo-judge": lambda **cfg: "judge"}

        @hookimpl
        def apertus_reward_functions(self):
            return {"always-one": lambda response, gt, **kw: 1.0}

        @hookimpl
        def apertus_target_rules(self):
            return {"no-op": lambda ids, labels, weights, spec: weights}

    pm = get_plugin_manager(load_entry_points=False)
    pm.register(Extras(), name="extras")
    reg = build_registry(pm)
    assert reg.judges["echo-judge"]() == "judge"
    assert reg.reward_functions["always-one"]("x", None) == 1.0
    assert "no-op" in reg.target_rules



def test_make_judge_builds_the_registered_backend_and_names_the_known_ones():
    from apertus_plugins.judges import OpenAIJudge

    judge = plugins.make_judge("openai", base_url="http://127.0.0.1:9/v1", model="judge", scale=(1, 5))
    assert isinstance(judge, OpenAIJudge) and judge.model == "judge"
    with pytest.raises(KeyError, match="unknown judge backend 'nope'; registered: .*openai"):
        plugins.make_judge("nope")

THIRD_PARTY_MODULE = '''
from apertus_plugins.plugins import Modality, hookimpl


def build(codes, spec, layout="frames", **kw):
    return list(codes)


@hookimpl
def apertus_modalities():
    return [Modality(name="video", codebook_size=16, placeholder="image", markers=(),
                     part_types=("video_url",), layouts=("frames",), build_sequence=build)]
'''


def test_third_party_modality_installed_with_pip_appears_in_registry(tmp_path: Path):
    """Build and pip-install a tiny distribution with an `apertus` entry point, then look in a fresh process."""
    src = tmp_path / "src"
    (src / "tiny_video").mkdir(parents=True)
    (src / "tiny_video" / "__init__.py").write_text(textwrap.dedent(THIRD_PARTY_MODULE))
    (src / "pyproject.toml").write_text(textwrap.dedent('''
        [build-system]
        requires = ["setuptools>=61"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "tiny-apertus-video"
        version = "0.0.1"
        [project.entry-points.apertus]
        video = "tiny_video"
        [tool.setuptools]
        packages = ["tiny_video"]
    '''))
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "--target", str(target), str(src)],
        check=True,
    )
    probe = (
        "import json; from apertus_plugins.plugins import registry; r = registry(); "
        "m = r.modalities['video']; print(json.dumps({'names': sorted(r.modalities), "
        "'part': r.modality_for_part('video_url').name, 'seq': m.build_sequence([3, 4], None)}))"
    )
    env = {"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    got = json.loads(out.stdout)
    assert got == {"names": ["audio", "image", "video"], "part": "video", "seq": [3, 4]}


def test_registry_is_cached_per_process():
    assert plugins.registry() is plugins.registry()


def test_adapters_add_apertus_commands_through_the_hook(monkeypatch, capsys):
    """``apertus convert`` comes from the Megatron adapter's plugin; the core imports no adapter."""
    from apertus_plugins import cli

    reg = plugins.registry()
    assert "convert" in reg.commands
    assert reg.plugins.get("megatron", "").startswith("<module 'megatron_patches.apertus_plugin'")
    with pytest.raises(SystemExit) as info:
        cli.main(["convert", "--help"])
    assert info.value.code == 0
    assert "to-megatron" in capsys.readouterr().out

    class Extra:
        @hookimpl
        def apertus_commands(self):
            def add_parser(sub):
                p = sub.add_parser("hello", help="say hello")
                p.set_defaults(func=lambda args: print("hello from a plugin") or 0)

            return {"hello": add_parser}

    pm = get_plugin_manager()
    pm.register(Extra(), name="extra")
    monkeypatch.setattr(plugins, "registry", lambda: build_registry(pm))
    assert cli.main(["hello"]) == 0
    assert capsys.readouterr().out == "hello from a plugin\n"


def test_core_modules_import_no_adapter():
    """The layering rule: nothing under apertus_plugins/ imports an adapter package."""
    root = Path(plugins.__file__).resolve().parent
    adapters = ("megatron_patches", "verl_ext", "vllm_model", "eval_tasks")
    offenders = [f"{py.relative_to(root.parent)}: {line.strip()}"
                 for py in root.rglob("*.py") for line in py.read_text().splitlines()
                 if line.strip().startswith(("import ", "from ")) and any(a in line.split("#")[0] for a in adapters)]
    assert not offenders, "the core imports adapters:\n" + "\n".join(offenders)
