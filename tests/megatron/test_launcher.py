"""The launcher and the argument group, without Megatron-LM (not installable here: no PyPI package).

* the ``--apertus-*`` group added to a real argparse parser the way Megatron's
  ``extra_args_provider`` does, chained with a script's own provider;
* version checks: the installed megatron-core 0.16.1 accepted, unsupported versions refused with
  the supported range named;
* the two training-entry forms told apart by ``pretrain``'s signature;
* ``apertus-megatron SCRIPT ...`` running a script as ``__main__`` with its arguments and the
  plugin active; a script that needs ``megatron.training`` without a Megatron-LM checkout refused.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from apertus_plugins.core.goldfish import GoldfishConfig
from apertus_plugins.core.targets import Schedule, TargetConfig
from megatron_patches.arguments import (
    GROUP_TITLE,
    add_apertus_args,
    chain_extra_args,
    options_from_args,
    parse_modality_weight,
)
from megatron_patches.errors import ApertusArgumentError
from megatron_patches.launcher import script_imports_megatron_training, training_form
from megatron_patches.version import MegatronVersionError, check_version, megatron_core_version, require_supported


def megatron_like_parser(extra: object = None) -> argparse.ArgumentParser:
    """What Megatron's ``parse_args`` does: its own arguments, then ``parser = extra_args_provider(parser)``."""
    parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    parser.add_argument("--num-layers", type=int)
    parser.add_argument("--tokenizer-model", default=None)
    if extra is not None:
        parser = extra(parser)  # type: ignore[operator]
    return parser


def user_provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument_group("user").add_argument("--my-flag", type=int, default=0)
    return parser


def test_argument_group_in_megatrons_parser(tokenizer_dir: Path) -> None:
    parser = megatron_like_parser(chain_extra_args(user_provider, add_apertus_args))
    assert GROUP_TITLE in [g.title for g in parser._action_groups]
    args = parser.parse_args(["--num-layers", "2", "--my-flag", "3", "--apertus-targets", "text-only",
                              "--apertus-goldfish-k", "50", "--apertus-goldfish-h", "50",
                              "--apertus-modality-weight", "audio=0:1,1000:0.5", "--apertus-tokenizer",
                              str(tokenizer_dir)])
    assert args.num_layers == 2 and args.my_flag == 3
    opts = options_from_args(args)
    want = TargetConfig.preset("text-only", opts.spec)
    assert opts.targets.excluded_names == want.excluded_names and opts.targets.modality_weights["image"] == 0.0
    assert isinstance(opts.targets.modality_weights["audio"], Schedule)
    assert opts.goldfish == GoldfishConfig(k=50, h=50, variant="hashtable")
    assert opts.spec.size == 1032  # the layout of the tokenizer directory
    # chained twice (a script that adds the group itself): still one group
    parser2 = megatron_like_parser(chain_extra_args(add_apertus_args, add_apertus_args))
    assert [g.title for g in parser2._action_groups].count(GROUP_TITLE) == 1
    # --tokenizer-model naming a tokenizer directory is the layout's default source
    args = parser.parse_args(["--tokenizer-model", str(tokenizer_dir)])
    assert options_from_args(args).spec.size == 1032 and options_from_args(args).goldfish is None


def test_argument_errors(tokenizer_dir: Path) -> None:
    parser = megatron_like_parser(add_apertus_args)
    base = ["--apertus-tokenizer", str(tokenizer_dir)]
    with pytest.raises(ApertusArgumentError, match="unknown modality 'video'"):
        options_from_args(parser.parse_args([*base, "--apertus-modality-weight", "video=1"]))
    with pytest.raises(ApertusArgumentError, match="unknown token name 'nope'"):
        options_from_args(parser.parse_args([*base, "--apertus-exclude-tokens", "nope"]))
    with pytest.raises(ApertusArgumentError, match="id 5000 outside the vocabulary 0..1031"):
        options_from_args(parser.parse_args([*base, "--apertus-exclude-ids", "5000"]))
    with pytest.raises(ApertusArgumentError, match="no tokenizer.json"):
        options_from_args(parser.parse_args(["--apertus-tokenizer", str(tokenizer_dir.parent)]))
    with pytest.raises(SystemExit):
        parser.parse_args(["--apertus-targets", "images-only"])
    assert parse_modality_weight("image=0.5") == ("image", 0.5)
    with pytest.raises(ValueError, match="expected NAME=W"):
        parse_modality_weight("image")


def test_version_checks() -> None:
    assert megatron_core_version() == "0.16.1"
    assert require_supported() == (0, 16)
    assert check_version("0.16.0") == (0, 16) and check_version("0.19.0rc1") == (0, 19)
    for bad in ("0.15.3", "0.17.1", "0.18.2", "1.0.0", "dev"):
        with pytest.raises(MegatronVersionError, match=r"0\.16\.x .* or 0\.19\.x"):
            check_version(bad)


def test_training_forms() -> None:
    def pretrain_016(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func,  # noqa: ANN001
                     process_non_loss_data_func=None, extra_args_provider=None, args_defaults=None):  # noqa: ANN001
        ...

    def pretrain_019(cfg_container, train_valid_test_dataset_provider, model_type, forward_step_func,  # noqa: ANN001
                     model_provider=None):  # noqa: ANN001
        ...

    def other(config, forward_step_func):  # noqa: ANN001
        ...

    assert training_form(pretrain_016) == "0.16" and training_form(pretrain_019) == "0.19"
    with pytest.raises(RuntimeError, match="neither supported form"):
        training_form(other)


def launcher(script: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).parent / "apertus-megatron"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "megatron_patches.launcher"]
    return subprocess.run([*cmd, str(script), *args], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ))


def test_launcher_runs_the_script_as_main(tmp_path: Path, tokenizer_dir: Path) -> None:
    (tmp_path / "helper_mod.py").write_text("VALUE = 41\n")
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import argparse, sys
        import helper_mod  # the script's own directory is importable, as with `python train.py`
        from megatron_patches.launcher import active
        from megatron_patches.arguments import add_apertus_args, options_from_args

        if __name__ == "__main__":
            state = active()
            parser = add_apertus_args(argparse.ArgumentParser())
            parser.add_argument("--lr", type=float)
            args = parser.parse_args()
            opts = options_from_args(args)
            print("main", helper_mod.VALUE + 1, sys.argv[0].endswith("train.py"), state.version, state.form,
                  args.lr, opts.targets.modality_weights, len(sys.argv))
    """))
    out = launcher(script, "--lr", "0.5", "--apertus-targets", "text-only", "--apertus-tokenizer", str(tokenizer_dir),
                   cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    # megatron-core 0.16's wheel has no megatron.training (form None); 0.19's packages it (form "0.19")
    version = megatron_core_version()
    form = "None" if require_supported() == (0, 16) else "0.19"
    assert f"main 42 True {version} {form} 0.5 {{'omni': 0.0, 'image': 0.0, 'audio': 0.0}} 7" in out.stdout


def test_launcher_errors(tmp_path: Path) -> None:
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("from megatron.training import pretrain\nprint('ran')\n")
    assert script_imports_megatron_training(script)
    out = launcher(script, "--num-layers", "2", cwd=tmp_path)
    if require_supported() == (0, 16):  # the 0.16 wheel has no megatron.training: a checkout is needed
        assert out.returncode == 2 and "ran" not in out.stdout
        assert "imports megatron.training, which the megatron-core wheel does not include" in out.stderr
        assert "0.16.x, 0.19.x" in out.stderr
    else:  # 0.19 packages megatron.training
        assert out.returncode == 0 and "ran" in out.stdout
    out = launcher(tmp_path / "missing.py", cwd=tmp_path)
    assert out.returncode == 2 and "missing.py: no such script" in out.stderr
    bad = tmp_path / "bad_args.py"
    bad.write_text(textwrap.dedent("""
        import argparse
        from megatron_patches.arguments import add_apertus_args, options_from_args
        options_from_args(add_apertus_args(argparse.ArgumentParser()).parse_args())
    """))
    out = launcher(bad, "--apertus-modality-weight", "video=1", cwd=tmp_path)
    assert out.returncode == 2 and "apertus-megatron: error: --apertus-modality-weight" in out.stderr
    assert "Traceback" not in out.stderr
    assert not script_imports_megatron_training(bad)
