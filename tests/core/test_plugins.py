"""The plugin manager: built-ins through the hooks, a third-party plugin through its entry point."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from apertus_plugins import plugins
from apertus_plugins.core.chat import ROLES
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
            return [Modality("image", "image", ("x",), ("l",), lambda *a, **k: None)]

    pm = get_plugin_manager(load_entry_points=False)
    pm.register(Clash(), name="clashing-plugin")
    with pytest.raises(ValueError, match="image.*registered twice.*clashing-plugin"):
        build_registry(pm)


def test_judges_and_rewards_are_collected():
    class Extras:
        @hookimpl
        def apertus_judges(self):
            return {"echo-judge": lambda **cfg: "judge"}

        @hookimpl
        def apertus_reward_functions(self):
            return {"always-one": lambda response, gt, **kw: 1.0}

    pm = get_plugin_manager(load_entry_points=False)
    pm.register(Extras(), name="extras")
    reg = build_registry(pm)
    assert reg.judges["echo-judge"]() == "judge"
    assert reg.reward_functions["always-one"]("x", None) == 1.0


def test_a_modality_claiming_a_used_omni_slot_or_name_is_an_error_naming_both():
    from apertus_plugins.core.vocab import VocabError

    def registry_with(slots):
        extra = Modality("probe", "probe", ("probe_url",), ("l",), lambda *a, **k: None, slots=slots)
        reg = build_registry(get_plugin_manager(load_entry_points=False))
        reg.modalities["probe"] = extra
        return reg

    with pytest.raises(VocabError, match=r"modality 'probe' claims omni slot 7 \('<\|probe\|>'\), which holds '<\|image\|>'"):
        registry_with({7: ("probe", "<|probe|>")}).spec()
    with pytest.raises(VocabError, match="names omni slot 20 'img_start', the name of slot 1"):
        registry_with({20: ("img_start", "<|img_start2|>")}).spec()
    spec = registry_with({20: ("probe", "<|probe|>")}).spec()
    assert spec.slots[20] == ("probe", "<|probe|>") and spec.media_kind("probe").part_types == ("probe_url",)
    assert spec.media_for_part("probe_url").name == "probe" and spec.id("probe") == spec.omni_offset + 20


def test_the_core_spec_is_pure_data_and_the_registry_hands_its_own_down():
    """Building a VocabSpec loads no plugin; the registry's spec is the core's plus the registered kinds."""
    from apertus_plugins.core.vocab import BUILTIN_MEDIA, VocabSpec, default_spec

    assert VocabSpec().media == BUILTIN_MEDIA and default_spec().media_placeholders()["image_url"] == "<|image|>"
    reg = build_registry(get_plugin_manager(load_entry_points=False))
    assert reg.spec().media == BUILTIN_MEDIA  # the built-in modalities are the core's kinds, no more
    assert [m.kind for m in reg.modalities.values()] == list(BUILTIN_MEDIA)


def test_a_hook_outside_the_contract_is_an_error_naming_plugin_and_hook():
    """``apertus_target_rules`` was declared once and never read; a plugin still implementing it
    (or a misspelled hook) is refused instead of being silently ignored."""
    class Old:
        @hookimpl
        def apertus_target_rules(self):
            return {"no-op": lambda ids, labels, weights, spec: weights}

    pm = get_plugin_manager(load_entry_points=False)
    pm.register(Old(), name="old-plugin")
    with pytest.raises(ValueError, match="'old-plugin'.*apertus_target_rules.*the hooks are apertus_commands"):
        build_registry(pm)
    assert not hasattr(plugins.Registry(), "target_rules")


def test_make_judge_builds_the_registered_backend_and_names_the_known_ones():
    from apertus_plugins.posttrain.judges import OpenAIJudge

    judge = plugins.make_judge("openai", base_url="http://127.0.0.1:9/v1", model="judge", scale=(1, 5),
                              charter="@sample")
    assert isinstance(judge, OpenAIJudge) and judge.model == "judge"
    with pytest.raises(KeyError, match="unknown judge backend 'nope'; registered: .*openai"):
        plugins.make_judge("nope")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_plugins"))
from install import install_plugin  # noqa: E402  (tests/_plugins: the example plugins and their installer)

#: Run with the plugin installed: registry, vocabulary, normalizer, template and tokenizer see ``video``.
VIDEO_PROBE = textwrap.dedent('''
    import json, sys
    import numpy as np
    from apertus_plugins import plugins
    from apertus_plugins.core.chat import ChatTokenizer, MediaItem, normalize_messages, render
    from apertus_plugins.core.chat.template import jinja_template
    from apertus_plugins.core.vocab import VocabSpec
    from apertus_plugins.testing.tokenizer_builder import build_test_tokenizer

    r = plugins.registry()
    spec = plugins.spec(VocabSpec.scaled())  # the scaled layout with the installed modalities
    tok_dir = build_test_tokenizer(sys.argv[1], spec)
    read = plugins.spec_from_tokenizer_dir(sys.argv[1])
    chat = ChatTokenizer(sys.argv[1], read)
    msgs = [{"role": "user", "content": [{"type": "text", "text": "what happens? <|video|>"},
                                         {"type": "video_url", "video_url": {"url": "clip.npy"}}]},
            {"role": "assistant", "content": "A ball rolls."}]
    norm = normalize_messages(msgs, read)
    text = render(msgs, variant="training", spec=read)
    plain = chat.encode_conversation(msgs, variant="training")
    seq = [spec.id("video_start"), spec.id("img_start"), 300, 301, spec.id("img_end"), spec.id("video_end")]
    full = chat.encode_conversation(msgs, variant="training", media=[MediaItem("video", seq)])
    vid = spec.id("video")
    k = full.ids.tolist().index(spec.id("video_start"))
    try:
        chat.encode_conversation(msgs, variant="training", media=[MediaItem("image", seq)])
        wrong = None
    except ValueError as exc:
        wrong = str(exc)
    print(json.dumps({
        "names": sorted(r.modalities), "part": r.modality_for_part("video_url").name,
        "ids": [plugins.spec().id(n) for n in ("video", "video_start", "video_end")],
        "pure": [n in VocabSpec().name_to_id for n in ("video", "video_start")],
        "read": [read.id(n) for n in ("video", "video_start", "video_end")],
        "normalized": norm[0]["content"] == {"parts": msgs[0]["content"]},
        "rendered": text,
        "template_media": jinja_template(spec=read).splitlines()[0],
        "checkpoint_template": open(sys.argv[1] + "/chat_template.jinja").read().splitlines()[0],
        "placeholders": int((plain.ids == vid).sum()),
        "expanded": full.ids[k:k + len(seq)].tolist() == seq and int((full.ids == vid).sum()) == 0,
        "roles": sorted(set(full.roles[k:k + len(seq)].tolist())),
        "wrong": wrong,
    }))
''')


def test_third_party_modality_installed_with_pip_goes_through_normalize_render_and_tokenize(tmp_path: Path):
    """The example ``video`` plugin, pip-installed: a ``video_url`` part is accepted, rendered as its
    placeholder, and tokenized to the placeholder id (or the item's sequence, in the image role);
    the same literal in user text stays text."""
    env = install_plugin(tmp_path / "site")
    out = subprocess.run([sys.executable, "-c", VIDEO_PROBE, str(tmp_path / "tok")], env=env,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout)
    assert got["names"] == ["audio", "image", "video"] and got["part"] == "video"
    assert got["ids"] == [131_072 + 16, 131_072 + 17, 131_072 + 18]  # omni slots 16-18 of the released layout
    assert got["pure"] == [False, False]  # the core's own spec knows only what it is given
    assert got["read"] == [512 + 16, 512 + 17, 512 + 18]  # and of the scaled test tokenizer written with the plugin
    assert got["normalized"]
    assert got["rendered"].endswith("<|user_start|>what happens? <|video|><|video|><|user_end|>"
                                    "<|assistant_start|>A ball rolls.<|assistant_end|>")
    assert '"video_url": "<|video|>"' in got["template_media"] and '"image_url": "<|image|>"' in got["template_media"]
    assert got["checkpoint_template"] == got["template_media"]  # a tokenizer written with the spec renders video
    assert got["placeholders"] == 1  # the part's; the literal in the user's text stays text
    assert got["expanded"] and got["roles"] == [ROLES.index("image")]  # video codes are image codes
    assert "media item 0 is 'image' but placeholder 0 is 'video'" in got["wrong"]


def test_without_the_plugin_a_video_part_is_refused_naming_the_known_types():
    from apertus_plugins.core.chat import ChatFormatError, normalize_messages

    with pytest.raises(ChatFormatError, match="unknown content part type 'video_url'.*image_url.*input_audio"):
        normalize_messages([{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "x"}}]}])


def test_a_plain_vocab_spec_and_render_load_no_plugin():
    """The core below the registry: building a VocabSpec and rendering import neither the registry nor pluggy."""
    probe = ("import sys\n"
             "from apertus_plugins.core.vocab import VocabSpec\n"
             "from apertus_plugins.core.chat import render\n"
             "VocabSpec(); render([{'role': 'user', 'content': [{'type': 'image_url', 'image_url': {'url': 'x'}}]}])\n"
             "print(sorted(m for m in sys.modules if m.startswith(('apertus_plugins.plugins', 'pluggy'))))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


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
