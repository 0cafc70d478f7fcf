"""Reward functions on real examples, through the plugin registry and verl's custom-reward path."""

from __future__ import annotations

import pytest

from apertus_plugins.plugins import registry
from apertus_plugins.posttrain.rewards import extract_answer
from verl_ext.rewards import _KeepSpecialTokens, compute_score

CALL = '<|tools_prefix|>[{{"answer": {{"answer": {arg}}}}}]<|tools_suffix|>'


def test_answer_tool_extraction_in_the_apertus_format():
    thinking = "<|inner_prefix|>2+2 is 4, not 5<|inner_suffix|>"
    assert extract_answer(thinking + CALL.format(arg='"4"')) == "4"
    assert extract_answer("<think>scratch</think>" + CALL.format(arg="4")) == "4"  # non-string JSON
    # a call inside the thinking span is not the final answer
    assert extract_answer("<|inner_prefix|>" + CALL.format(arg='"5"') + "<|inner_suffix|>The answer is 4") \
        == "The answer is 4"
    assert extract_answer("<|inner_prefix|>never closed") is None
    assert extract_answer("plain 4", require_tool=True) is None
    assert extract_answer('<|tools_prefix|>[{"submit": {"value": "x"}}]<|tools_suffix|>', tool_name="submit") == "x"


def test_math_verify_on_real_answers():
    fn = registry().reward_functions["math_verify"]
    assert fn(CALL.format(arg='"\\\\frac{1}{2}"'), "$0.5$") == 1.0
    assert fn("The result is $\\boxed{x^2+2x+1}$", "$(x+1)^2$") == 1.0
    assert fn("So the answer is $\\boxed{3}$.", "$4$") == 0.0
    assert fn("<|inner_prefix|>is it 12?<|inner_suffix|>It is $\\boxed{13}$", "$13$") == 1.0
    assert fn("", "$1$") == 0.0


def test_ifeval_checkers_on_real_examples():
    fn = registry().reward_functions["ifeval"]
    lower = {"instruction_id_list": ["change_case:english_lowercase"], "kwargs": [{}]}
    assert fn("all of this is lowercase.", lower) == 1.0
    assert fn("This Is Not.", lower) == 0.0
    two = {"instruction_id_list": ["detectable_format:number_bullet_lists", "keywords:existence"],
           "kwargs": [{"num_bullets": 2}, {"keywords": ["apple"]}]}
    good = "* an apple\n* a pear"
    assert fn(good, two) == 1.0
    assert fn("* a pear\n* a plum", two) == 0.0
    assert fn("* a pear\n* a plum", two, strict=False) == 0.5
    assert fn("<|inner_prefix|>draft<|inner_suffix|>" + good, two) == 1.0
    with pytest.raises(ValueError, match="unknown IFEval instruction id"):
        fn("x", {"instruction_id_list": ["no:such"], "kwargs": [{}]})



def test_ifeval_sentence_checker_without_nltk_data_names_the_instruction_and_the_fix(tmp_path, monkeypatch):
    import nltk

    monkeypatch.setattr(nltk.data, "path", [str(tmp_path)])  # an nltk data folder without punkt_tab
    fn = registry().reward_functions["ifeval"]
    sentences = {"instruction_id_list": ["length_constraints:number_sentences"],
                 "kwargs": [{"num_sentences": 2, "relation": "at least"}]}
    with pytest.raises(LookupError, match="'length_constraints:number_sentences' needs nltk data.*punkt_tab"):
        fn("One sentence. Two sentences.", sentences)

def test_exact_match_and_verl_compute_score_dispatch():
    fn = registry().reward_functions["exact_match"]
    assert fn(CALL.format(arg='"Paris"'), "paris") == 1.0
    assert fn("  Paris. ", ["Lyon", "Paris"]) == 1.0
    assert fn("Lyon", "Paris") == 0.0
    assert compute_score("math_verify", "$\\boxed{2}$", "$2$") == 1.0
    assert compute_score("gsm8k", "Paris", "Paris", extra_info={"reward_fn": "exact_match"}) == 1.0
    assert compute_score("other", "4", "4", default_reward_fn="exact_match") == 1.0
    with pytest.raises(ValueError, match="no reward function for data_source 'other'"):
        compute_score("other", "4", "4")


def test_reward_manager_decode_keeps_the_tool_call_markers(tmp_path):
    from transformers import PreTrainedTokenizerFast

    from apertus_plugins.core.chat import ChatTokenizer
    from apertus_plugins.testing.tokenizer_builder import build_test_tokenizer

    d = build_test_tokenizer(tmp_path)
    hf = PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"))
    ct = ChatTokenizer(d)
    ids = ([ct.spec.id("tools_prefix")] + ct.text_ids('[{"answer": {"answer": "42"}}]')
           + [ct.spec.id("tools_suffix")])
    hf.add_special_tokens({"additional_special_tokens": ["<|tools_prefix|>", "<|tools_suffix|>"]})
    plain = hf.decode(ids, skip_special_tokens=True)  # what verl's naive manager sees
    assert "<|tools_prefix|>" not in plain and extract_answer(plain, require_tool=True) is None
    kept = _KeepSpecialTokens(hf).decode(ids, skip_special_tokens=True)
    assert extract_answer(kept, require_tool=True) == "42"


def test_verl_builds_the_apertus_reward_manager_from_the_rlvr_config(tmp_path):
    """verl's reward loop builds the manager with keyword arguments (verl.trainer.ppo.reward.load_reward_manager)."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from transformers import PreTrainedTokenizerFast
    from verl.trainer.ppo.reward import load_reward_manager

    from apertus_plugins.testing.tokenizer_builder import build_test_tokenizer
    from verl_ext import rewards

    rewards.register_reward_manager()
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="verl_ext.config", version_base=None):
        cfg = compose(config_name="apertus_rlvr")
    hf = PreTrainedTokenizerFast(tokenizer_file=str(build_test_tokenizer(tmp_path) / "tokenizer.json"))
    manager = load_reward_manager(cfg, hf, reward_router_address=None, reward_model_tokenizer=None)
    assert type(manager).__name__ == "ApertusRewardManager"
    assert isinstance(manager.tokenizer, _KeepSpecialTokens)
    assert manager.compute_score("exact_match", "4", "4") == 1.0
