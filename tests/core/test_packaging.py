"""The built wheel: every data file the packages ship (templates, configs, task YAMLs, demo media) and the
entry points the frameworks discover (vLLM, verl, lmms-eval, the ``apertus`` plugins, console scripts)."""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("apertus_plugins", "megatron_patches", "verl_ext", "vllm_model", "eval_tasks")


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if line and (ROOT / line).is_file()]


def test_the_wheel_ships_every_package_file_and_the_entry_points(tmp_path):
    src = tmp_path / "src"
    for name in _tracked():  # a copy of the tracked tree: the build leaves nothing in the checkout
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, src / name)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("apertus_plugins-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())

    wanted = {name for name in _tracked() if name.split("/")[0] in PACKAGES}
    missing = sorted(wanted - shipped)
    assert not missing, f"tracked package files missing from the wheel: {missing}"
    assert {"apertus_plugins/core/chat/apertus1p5.jinja", "verl_ext/config/apertus_sdpo.yaml",
            "apertus_plugins/assets/demo.wav"} <= shipped

    meta = next(n for n in shipped if n.endswith(".dist-info/entry_points.txt"))
    found = configparser.ConfigParser()
    found.optionxform = str  # keep the case of the names
    found.read_string(zipfile.ZipFile(wheel).read(meta).decode())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {"console_scripts": project["scripts"], **project["entry-points"]}
    assert {group: dict(found[group]) for group in found.sections()} == declared
    for group in ("vllm.general_plugins", "verl.plugins", "lmms_eval.models", "apertus"):
        assert group in declared, group
