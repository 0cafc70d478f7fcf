"""The overrides (``megatron_patches.overrides``) that megatron-core 0.16.1 alone can check; Megatron-LM's in megatron-train.

* the megatron-core function the adapter wraps still has the source it was written against (an
  edit fails here naming the function);
* a changed upstream signature is refused naming the function, the parameters the wrapper binds and
  the versions it was checked on;
* a source digest changes with the function's text and nothing else;
* the 0.16 ``pretrain`` wrapper passes the Apertus providers and the chained argument group through
  ``pretrain``'s own parameters and everything else through untouched;
* the interval accounting of the ``training_log`` override, against Megatron-LM's accounting rule
  (each trained step's losses added; ``accumulator / advanced iterations`` printed; a reset after
  every line but a run's first);
* the documentation lists every override.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_patches import overrides
from megatron_patches.arguments import GROUP_TITLE
from megatron_patches.overrides import OVERRIDES, IntervalLosses, UpstreamChangedError, check, digest_in_source
from megatron_patches.version import megatron_core_version

ROOT = Path(__file__).resolve().parents[2]


def importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


HERE = [o for o in OVERRIDES if importable(o.module)]  # megatron-core's (Megatron-LM is not installable with 0.16)


def test_the_optimizer_override_is_checked_here() -> None:
    assert "megatron.core.optimizer._get_megatron_optimizer_based_on_param_groups" in [o.target for o in HERE]


@pytest.mark.parametrize("override", HERE, ids=lambda o: o.target)
def test_upstream_function_unchanged(override: overrides.Override) -> None:
    problem = overrides.digest_problem(override, megatron_core_version())
    assert problem is None, problem


def test_a_changed_signature_is_refused_naming_the_function() -> None:
    override = next(o for o in OVERRIDES if o.name == "train_step")

    def train_step(data_iterator, model, optimizer, iteration=None):  # noqa: ANN001, ANN202 - upstream's shape, changed
        ...

    with pytest.raises(UpstreamChangedError) as err:
        check(override, train_step)
    message = str(err.value)
    assert "megatron.training.training.train_step" in message and "'forward_step_func'" in message
    assert "checked on 0.16.1, 0.19.2" in message
    missing = next(o for o in OVERRIDES if o.name == "parse_and_validate_args")
    if not importable("megatron.training"):  # megatron-core 0.16's wheel: no Megatron-LM, named as missing
        with pytest.raises(UpstreamChangedError, match=r"megatron\.training\.arguments\.parse_and_validate_args is "
                                                        "missing"):
            check(missing)


def test_digest_follows_the_function_only() -> None:
    source = "import os\n\n\ndef f(a, b):\n    return a + b\n\n\ndef g():\n    return 1\n"
    base = digest_in_source(source, "f")
    assert digest_in_source(source.replace("return 1", "return 2"), "f") == base
    assert digest_in_source(source.replace("a + b", "a - b"), "f") != base
    assert digest_in_source("@decorated\n" + source.split("\n\n\n", 1)[1], "f") != base  # decorators count
    with pytest.raises(UpstreamChangedError, match="no module-level function 'h'"):
        digest_in_source(source, "h")


def test_pretrain_016_passes_the_apertus_parts_through_pretrains_parameters() -> None:
    from megatron_patches import training

    calls: list[dict[str, Any]] = []

    def pretrain(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func,  # noqa: ANN001, ANN202
                 process_non_loss_data_func=None, extra_args_provider=None, args_defaults={},  # noqa: ANN001, B006
                 get_embedding_ranks=None, get_position_embedding_ranks=None, non_loss_data_func=None,  # noqa: ANN001
                 store=None, inprocess_call_wrapper=None):  # noqa: ANN001
        calls.append(dict(locals()))

    def own(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        parser.add_argument("--own-flag")
        return parser

    wrapped = overrides._pretrain_016(pretrain)
    wrapped("script datasets", "script model", "encoder_or_decoder", "script forward", None, own,
            args_defaults={"tokenizer_type": "GPT2BPETokenizer"}, store="store", get_embedding_ranks="ranks")
    (a,) = calls
    assert a["train_valid_test_dataset_provider"] is training.train_valid_test_datasets_provider
    assert a["model_provider"] is training.model_provider and a["forward_step_func"] is training.forward_step
    assert a["model_type"] == "encoder_or_decoder" and a["store"] == "store" and a["get_embedding_ranks"] == "ranks"
    assert a["args_defaults"] == {"tokenizer_type": "GPT2BPETokenizer"}
    parser = a["extra_args_provider"](argparse.ArgumentParser())
    assert GROUP_TITLE in [g.title for g in parser._action_groups]
    assert parser.parse_args(["--own-flag", "x", "--apertus-embedding-rows", "7"]).padded_vocab_size == 7


# Megatron-LM's training_log (0.16.1 and 0.19.2, the source digests above pin it): a trained step's losses are
# added to the accumulator, a skipped step's are not; a log line prints accumulator[key] / advanced iterations
# for every key the accumulator holds, then zeroes the keys and the counters, except after a run's first line.
def megatron_training_log(acc: dict[str, Any], losses: dict[str, torch.Tensor], skipped: bool, log: bool,
                          first: bool) -> dict[str, float] | None:
    adv = "advanced iterations"
    acc[adv] = acc.get(adv, 0) + (0 if skipped else 1)
    if not skipped:
        for k, v in losses.items():
            acc[k] = acc.get(k, torch.tensor([0.0])) + v
    if not log:
        return None
    line = {k: float(v.item()) / max(1, acc[adv]) for k, v in acc.items() if k != adv}
    if not first:
        acc[adv] = 0
        for k in line:
            acc[k] = torch.tensor([0.0])
    return line


def log_run(steps: list[tuple[dict[str, float], bool]], log_interval: int) -> dict[int, dict[str, float]]:
    """Megatron's lines of a run through :class:`IntervalLosses` (what the ``training_log`` override does)."""
    interval, acc, lines = IntervalLosses(), {}, {}
    for i, (losses, skipped) in enumerate(steps, start=1):
        first = i == 1 and i % log_interval != 0
        log = i % log_interval == 0 or first
        values = {k: torch.tensor(v) for k, v in losses.items()}
        interval.prepare(acc, values, skipped=skipped, log_now=log)
        line = megatron_training_log(acc, values, skipped, log, first)
        interval.finish(acc, interval_ended=log and not first)
        if line is not None:
            lines[i] = line
    return lines


def test_interval_means_over_the_steps_that_had_each_key() -> None:
    steps = [({"lm loss": 4.0, "text loss": 3.0, "image loss": 6.0}, False),
             ({"lm loss": 2.0, "text loss": 1.0}, False),  # no image targets
             ({}, True),  # no targets at all: skipped, no losses
             ({"lm loss": 3.0, "text loss": 2.0}, False),
             ({}, True),
             ({}, True)]
    lines = log_run(steps, log_interval=2)
    assert lines[1] == pytest.approx({"lm loss": 4.0, "text loss": 3.0, "image loss": 6.0})  # the first line
    # steps 1-2: the image loss over the one step that had image targets, never averaged with a missing step
    assert lines[2] == pytest.approx({"lm loss": 3.0, "text loss": 2.0, "image loss": 6.0})
    assert lines[4] == pytest.approx({"lm loss": 3.0, "text loss": 2.0})  # a skipped step does not dilute
    assert lines[6] == {}  # an interval without a trained step logs no loss (upstream: lm loss 0)
    every = log_run(steps, log_interval=1)
    assert every[2] == pytest.approx({"lm loss": 2.0, "text loss": 1.0}) and every[3] == {} and every[5] == {}
    # a key in every trained step is Megatron's own sum, bit for bit
    plain = log_run([({"lm loss": 0.1}, False), ({"lm loss": 0.7}, False), ({"lm loss": 0.3}, False)], 3)
    assert plain[3]["lm loss"] == float((torch.tensor([0.0]) + torch.tensor(0.1) + torch.tensor(0.7)
                                         + torch.tensor(0.3)).item()) / 3


def test_the_documentation_lists_every_override() -> None:
    text = (ROOT / "docs" / "megatron.md").read_text(encoding="utf-8")
    section = text.split("## How the plugin enters Megatron", 1)
    assert len(section) == 2, "docs/megatron.md has no 'How the plugin enters Megatron' section"
    body = section[1].split("\n## ", 1)[0]
    for o in OVERRIDES:
        assert f"`{o.target}`" in body, o.target
    for o in OVERRIDES:
        assert o.does and o.why and o.checked
        assert inspect.isfunction(o.make)
