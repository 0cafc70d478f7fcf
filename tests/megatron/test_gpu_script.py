"""The CPU-side parts of the prepared GPU script (benchmarks/gpu/megatron_smoke.py).

The data it writes passes the plugin's preflight and builds with megatron-core's builder under
the exact flags it passes; its log reader understands Megatron's training-log lines and refuses a
run whose loss did not fall or that logged no per-modality losses; a missing Megatron-LM
checkout or GPU is a clear error.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from conftest import null_tokenizer

from apertus_plugins.core.goldfish import GoldfishConfig
from megatron_patches.arguments import add_apertus_args, options_from_args
from megatron_patches.training import data_prefixes, preflight

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def smoke() -> ModuleType:
    spec = importlib.util.spec_from_file_location("megatron_smoke", ROOT / "benchmarks" / "gpu" / "megatron_smoke.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def run_data(smoke: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return smoke.write_data(tmp_path_factory.mktemp("smoke"))


def parsed(smoke: ModuleType, run_data: dict[str, Any], out: Path) -> tuple[argparse.Namespace, list[str]]:
    parser = add_apertus_args(argparse.ArgumentParser())
    for flag in ("--data-path", "--seq-length", "--seed"):
        parser.add_argument(flag, nargs="+" if flag == "--data-path" else None)
    return parser.parse_known_args(smoke.megatron_flags(run_data, out))


def test_flags_and_data_pass_preflight(smoke: ModuleType, run_data: dict[str, Any], tmp_path: Path,
                                       process_group: None) -> None:
    from megatron_patches.dataset import ApertusDatasetConfig, build_datasets

    args, rest = parsed(smoke, run_data, tmp_path)
    assert "--bf16" in rest and "--transformer-impl" in rest  # Megatron's own flags, left to Megatron
    opts = options_from_args(args)
    assert opts.optimizer == "ademamix" and opts.goldfish == GoldfishConfig(k=50, h=50, variant="hashtable")
    weights, prefixes = args.data_path[0::2], args.data_path[1::2]
    preflight(opts, data_prefixes((prefixes, None), None), embedding_rows=opts.embedding_rows)
    assert opts.embedding_rows % 128 == 0 and opts.embedding_rows > run_data["vocab"]
    tok = null_tokenizer(run_data["vocab"])
    config = ApertusDatasetConfig(random_seed=int(args.seed), sequence_length=int(args.seq_length),
                                  blend=(prefixes, [float(w) for w in weights]), split="100,0,0", tokenizer=tok,
                                  path_to_cache=str(tmp_path / "cache"), apertus=opts)
    train = build_datasets(config, [64, 0, 0])[0]
    kinds = {bool(train.datasets[int(train[i]["dataset_id"])].is_sft) for i in range(64)}
    assert kinds == {False, True}
    counts = sum((train[i]["modality"] == m).sum().item() > 0 for i in range(16) for m in (0, 1, 2, 3))
    assert counts > 16  # samples hold more than text


LOG_LINE = (" [2026-12-03 08:00:00.000000] iteration {it:8d}/      40 | consumed samples: {s:12d} | elapsed time per "
            "iteration (ms): 123.4 | learning rate: 3.000000E-03 | global batch size:    16 | lm loss: {lm:.6E} |"
            "{mods} loss scale: 1.0 | grad norm: 1.234 | number of skipped iterations:   0 | number of nan "
            "iterations:   0 |")


def log(rows: list[tuple[int, float]], mods: tuple[str, ...] = ("text", "omni", "image", "audio")) -> str:
    return "\n".join(LOG_LINE.format(it=it, s=it * 16, lm=lm, mods="".join(f" {m} loss: {lm + 0.5:.6E} |" for m in mods))
                     for it, lm in rows)


def test_log_reader(smoke: ModuleType) -> None:
    rows = smoke.parse_log("setup noise\n" + log([(5, 6.9), (10, 6.1), (40, 3.2)]))
    assert [r["iteration"] for r in rows] == [5.0, 10.0, 40.0]
    assert rows[-1]["lm loss"] == 3.2 and rows[-1]["image loss"] == 3.7 and rows[-1]["ms per iteration"] == 123.4
    result = smoke.check_log(rows)
    assert result["lm loss ratio"] == pytest.approx(3.2 / 6.9)
    with pytest.raises(smoke.SmokeError, match="did not fall"):
        smoke.check_log(smoke.parse_log(log([(5, 6.9), (40, 6.5)])))
    with pytest.raises(smoke.SmokeError, match="per-modality losses"):
        smoke.check_log(smoke.parse_log(log([(5, 6.9), (40, 3.0)], mods=("text",))))
    with pytest.raises(smoke.SmokeError, match="found 0 training-log lines"):
        smoke.check_log(smoke.parse_log("no training happened"))


def test_missing_checkout_and_gpu(smoke: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("MEGATRON_LM", raising=False)
    assert smoke.main(["run", "--out", str(tmp_path / "o")]) == 1
    assert "no Megatron-LM checkout: set MEGATRON_LM" in capsys.readouterr().err
    assert smoke.main(["run", "--megatron-lm", str(tmp_path), "--out", str(tmp_path / "o")]) == 1
    assert "not a Megatron-LM checkout (missing pretrain_gpt.py, megatron/training/__init__.py)" in \
        capsys.readouterr().err
    checkout = tmp_path / "Megatron-LM"
    (checkout / "megatron" / "training").mkdir(parents=True)
    (checkout / "megatron" / "training" / "__init__.py").write_text("")
    (checkout / "pretrain_gpt.py").write_text("")
    monkeypatch.setenv("MEGATRON_LM", str(checkout))
    assert smoke.main(["run", "--out", str(tmp_path / "o")]) == 1  # this machine has no CUDA
    assert "no CUDA device" in capsys.readouterr().err


# ------------------------------------------------------------------------------ the context-parallel check
@pytest.fixture(scope="module")
def cp_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("megatron_context_parallel",
                                                  ROOT / "benchmarks" / "gpu" / "megatron_context_parallel.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cp_check_flags_build_packed_samples(cp_check: ModuleType, run_data: dict[str, Any], tmp_path: Path,
                                             process_group: None) -> None:
    """The check's flags parse, pass the preflight, and build samples whose documents split over 2 CP ranks."""
    from apertus_plugins.core.packing import cp_partition_indices
    from megatron_patches.dataset import ApertusDatasetConfig, build_datasets

    parser = add_apertus_args(argparse.ArgumentParser())
    for flag in ("--data-path", "--seq-length", "--seed"):
        parser.add_argument(flag, nargs="+" if flag == "--data-path" else None)
    parser.add_argument("--context-parallel-size", type=int, default=1)
    flags = cp_check.megatron_flags(run_data)
    args, rest = parser.parse_known_args([*flags, "--context-parallel-size", "2"])
    assert "--transformer-impl" in rest and "transformer_engine" in rest and "--bf16" in rest
    opts = options_from_args(args)
    assert opts.packed_sequences and opts.pad_multiple == 4 and opts.goldfish is not None
    prefixes = args.data_path[1::2]
    preflight(opts, data_prefixes((prefixes, None), None), embedding_rows=opts.embedding_rows)
    config = ApertusDatasetConfig(random_seed=1, sequence_length=int(args.seq_length),
                                  blend=(prefixes, [float(w) for w in args.data_path[0::2]]), split="100,0,0",
                                  tokenizer=null_tokenizer(run_data["vocab"]), path_to_cache=str(tmp_path / "cache"),
                                  apertus=opts)
    train = build_datasets(config, [8, 0, 0])[0]
    for i in range(8):
        cu = train[i]["cu_seqlens"].numpy()
        assert cu.size > 2  # several documents per sequence
        halves = [cp_partition_indices(cu, 2, r) for r in (0, 1)]
        assert sorted(halves[0].tolist() + halves[1].tolist()) == list(range(int(args.seq_length)))


def test_cp_check_comparison_and_errors(cp_check: ModuleType, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    one = [{"iteration": 1.0, "lm loss": 7.0, "text loss": 7.1}, {"iteration": 2.0, "lm loss": 6.0, "text loss": 6.1}]
    near = [{"iteration": 1.0, "lm loss": 7.01, "text loss": 7.1}, {"iteration": 2.0, "lm loss": 6.0, "text loss": 6.12}]
    result = cp_check.compare(one, near, 2e-2)
    assert result["iterations"] == 2 and result["max relative difference"]["lm loss"] == pytest.approx(0.01 / 7)
    with pytest.raises(cp_check.CpCheckError, match="iteration 2: text loss 6.100000 at CP=1, 7.000000 at CP=2"):
        cp_check.compare(one, [near[0], {"iteration": 2.0, "lm loss": 6.0, "text loss": 7.0}], 2e-2)
    with pytest.raises(cp_check.CpCheckError, match="different iterations"):
        cp_check.compare(one, one[:1], 2e-2)
    with pytest.raises(cp_check.CpCheckError, match="iteration 1: CP=1 logged"):
        cp_check.compare(one, [{"iteration": 1.0, "lm loss": 7.0}, one[1]], 2e-2)
    assert cp_check.main(["run", "--out", str(tmp_path / "o")]) == 1  # this machine has no GPU
    assert "needs two CUDA GPUs, found 0" in capsys.readouterr().err
    monkeypatch.delenv("MEGATRON_LM", raising=False)
    from megatron_patches.version import require_supported

    if require_supported() == (0, 16):  # no megatron.training in the 0.16 wheel
        with pytest.raises(cp_check.CpCheckError, match="set MEGATRON_LM"):
            cp_check.training_script(None)
