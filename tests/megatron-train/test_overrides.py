"""The overrides (``megatron_patches.overrides``) against Megatron-LM 0.19.2 and megatron-core 0.19.2, in this process.

* every upstream function the adapter wraps on 0.19 still has the source it was written against:
  an edit fails here, naming the function, what the wrapper relies on, and the digest to record
  once it is re-read;
* installing the overrides checks and wraps each function once, keeps upstream's reachable, and
  binds ``megatron.training.pretrain`` (the name scripts import) to the same wrapper; a function
  whose parameters changed stops the launcher naming it, before anything is wrapped;
* the 0.19 ``pretrain`` wrapper hands Megatron a copy of the script's config container whose model
  is the Apertus model config (the plugin's builder, Megatron's own extension path), the Apertus
  dataset provider and forward step, everything else untouched, and leaves the script's container
  as it was.

The training runs of this suite exercise what the wrappers do (steps without targets, the log).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import ROOT

from megatron_patches import overrides
from megatron_patches.overrides import TRAINING, applicable
from megatron_patches.version import megatron_core_version

ON_019 = applicable("0.19")


def test_every_override_of_the_019_entry_is_checked() -> None:
    names = {o.target for o in ON_019}
    assert names == {f"{TRAINING}.pretrain", "megatron.training.arguments.parse_and_validate_args",
                     f"{TRAINING}.train_step", f"{TRAINING}.training_log",
                     "megatron.core.optimizer._get_megatron_optimizer_based_on_param_groups"}


@pytest.mark.parametrize("override", ON_019, ids=lambda o: o.target)
def test_upstream_function_unchanged(override: overrides.Override) -> None:
    problem = overrides.digest_problem(override, megatron_core_version())
    assert problem is None, problem


@pytest.fixture
def installed() -> Iterator[list[str]]:
    """The 0.19 overrides installed in this process, upstream's functions restored afterwards."""
    before = {(o.module, o.name): getattr(importlib.import_module(o.module), o.name) for o in ON_019}
    aliases = {(m, o.name): getattr(importlib.import_module(m), o.name) for o in ON_019 for m in o.also}
    try:
        yield overrides.install("0.19")
    finally:
        for (module, name), fn in [*before.items(), *aliases.items()]:
            setattr(importlib.import_module(module), name, fn)


def test_install_wraps_each_function_once(installed: list[str]) -> None:
    assert sorted(installed) == sorted(o.target for o in ON_019)
    assert overrides.installed("0.19")
    wrapped = {o.target: getattr(importlib.import_module(o.module), o.name) for o in ON_019}
    assert overrides.install("0.19") == installed  # idempotent: nothing wrapped twice
    for o in ON_019:
        fn = getattr(importlib.import_module(o.module), o.name)
        assert fn is wrapped[o.target] and inspect.unwrap(fn) is fn.__apertus_original__
        assert list(inspect.signature(fn).parameters) == list(inspect.signature(fn.__apertus_original__).parameters)
    import megatron.training

    assert megatron.training.pretrain is wrapped[f"{TRAINING}.pretrain"]


def test_the_launcher_stops_naming_a_changed_function() -> None:
    code = textwrap.dedent("""
        import megatron.training.training as t

        def train_step(data_iterator, model, optimizer, iteration=None):  # upstream's, one parameter gone
            return {}

        t.train_step = train_step
        from megatron_patches import launcher

        try:
            launcher.activate()
        except launcher.LauncherError as exc:
            print("refused:", exc)
        print("wrapped:", [n for n in ("pretrain", "training_log") if hasattr(getattr(t, n), "__apertus_original__")])
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "refused: megatron.training.training.train_step('data_iterator', 'model', 'optimizer', 'iteration') has " \
           "changed: apertus-megatron's wrapper binds ['forward_step_func', 'data_iterator', 'model', 'optimizer'] " \
           "first" in out.stdout, out.stdout
    assert "checked on 0.16.1, 0.19.2" in out.stdout and "wrapped: []" in out.stdout


def test_pretrain_hands_megatron_a_copy_of_the_container_with_the_apertus_model() -> None:
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.training.config.container import PretrainConfigContainer
    from megatron.training.config.training_config import (
        CheckpointConfig,
        LoggerConfig,
        SchedulerConfig,
        TrainingConfig,
    )
    from megatron.training.models.gpt import GPTModelConfig

    from megatron_patches import training
    from megatron_patches.model_builder import ApertusModelBuilder, ApertusModelConfig

    upstream = inspect.unwrap(importlib.import_module(TRAINING).pretrain)
    calls: list[dict[str, Any]] = []

    def pretrain(*args: Any, **kwargs: Any) -> None:
        calls.append(inspect.signature(upstream).bind(*args, **kwargs).arguments)

    pretrain.__signature__ = inspect.signature(upstream)  # type: ignore[attr-defined]
    transformer = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True)
    model = GPTModelConfig(transformer=transformer, vocab_size=1152, position_embedding_type="rope",
                           rope_scaling=True, seq_length=128)
    container = PretrainConfigContainer(train=TrainingConfig(), model=model, optimizer=OptimizerConfig(),
                                        scheduler=SchedulerConfig(), logger=LoggerConfig(),
                                        checkpoint=CheckpointConfig())
    before = {f.name: getattr(model, f.name) for f in dataclasses.fields(model)}
    overrides._pretrain_019(pretrain)(container, "script datasets", "encoder_or_decoder", "script forward",
                                      store="store")
    (a,) = calls
    assert a["train_valid_test_dataset_provider"] is training.train_valid_test_datasets_provider
    assert a["forward_step_func"] is training.forward_step
    assert a["model_type"] == "encoder_or_decoder" and a["store"] == "store" and "model_provider" not in a
    given = a["cfg_container"]
    assert given is not container and type(given) is PretrainConfigContainer
    assert type(given.model) is ApertusModelConfig and given.model.get_builder_cls() is ApertusModelBuilder
    assert given.model.transformer is transformer and given.optimizer is container.optimizer
    assert all(getattr(given.model, name) is value for name, value in before.items())
    # the script's container and model config are as the script built them
    assert container.model is model and type(model) is GPTModelConfig
    assert all(getattr(model, name) is value for name, value in before.items())
