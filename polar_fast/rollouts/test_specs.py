"""How a published task's tests run: the command, the environment and the log parser, per repo.

The values follow the test specs of SWE-bench's harness (the SWE-bench / Verified / Lite repos)
and of SWE-Gym's fork of it (the SWE-Gym repos): for each repo a test command, the repo-specific
commands run before it (`eval_commands`), the install command SWE-bench re-runs at eval time (so
an agent's change to a compiled extension is built), and the log parser (log_parsers.py). The
command's arguments are the "test directives" of the test patch: its files, except non-test
extensions; for django, modules relative to tests/ with dots; for mypy, the `[case NAME]` keys
joined into one `-k` expression.

Only the log between SWE-bench's start and end markers is parsed, so install output never
counts as a test line. The environment is the image's, as SWE-bench uses it: the conda install at /opt/miniconda3, env
`testbed`, repo at /testbed. The script runs under bash without `set -e`, as SWE-bench's eval
script does, so an install step that needs the network (boxes have none) fails harmlessly and
the tests still run against what the image installed.

Deliberate omissions: the image build steps (pre_install, environment files) are not here,
because the published images already ran them; SWE-Gym repos whose install fetches from the
network (MONAI, dvc, bokeh, conan) get no eval-time install for the same reason.
"""

from __future__ import annotations

import re
import shlex

import msgspec

CONDA_ACTIVATE = ["source /opt/miniconda3/bin/activate", "conda activate testbed"]
START_TESTS, END_TESTS = ">>>>> Start Test Output", ">>>>> End Test Output"  # SWE-bench's markers
NON_TEST_SUFFIXES = (".json", ".png", "csv", ".txt", ".md", ".jpg", ".jpeg", ".pkl", ".yml", ".yaml", ".toml")

PYTEST = "pytest -rA"
PYTEST_N0 = "pytest -n0 -rA"
DJANGO = "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1"
DJANGO_LOCALE = ["export LANG=en_US.UTF-8", "export LANGUAGE=en_US:en", "export LC_ALL=en_US.UTF-8"]
PIP_EDITABLE = "python -m pip install -e ."


class RepoSpec(msgspec.Struct, frozen=True, kw_only=True):
    test_cmd: str
    parser: str = "pytest"  # a log_parsers.PARSERS name
    directives: str = "files"  # files | django | mypy
    install: str = ""  # re-run before the tests, as SWE-bench's eval script does
    eval_commands: tuple[str, ...] = ()


def _v(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version)) or (0,)


def _django(version: str) -> RepoSpec:
    v = _v(version)
    cmd = "./tests/runtests.py --verbosity 2" if version == "1.9" else DJANGO
    install = PIP_EDITABLE if v >= (3, 0) else "python setup.py install"
    env: tuple[str, ...] = ()
    if (1, 7) <= v < (3, 0):
        env = (*DJANGO_LOCALE, "export PYTHONIOENCODING=utf8")
    elif (3, 0) <= v < (4, 0):
        env = ("sed -i '/en_US.UTF-8/s/^# //g' /etc/locale.gen && locale-gen", *DJANGO_LOCALE)
    return RepoSpec(test_cmd=cmd, parser="django", directives="django", install=install, eval_commands=env)


def _astropy(version: str) -> RepoSpec:
    old = _v(version) < (3, 0)  # the pytest 3 era prints ids the verbose way
    cmd = "pytest -rA -vv -o console_output_style=classic --tb=no" if old else PYTEST
    return RepoSpec(test_cmd=cmd, parser="pytest_v2", install="python -m pip install -e .[test] --verbose")


def _matplotlib(version: str) -> RepoSpec:
    v = _v(version)
    if v < (3, 0):
        install = "python setup.py build; python setup.py install"
    elif v >= (3, 8):
        install = 'python -m pip install --no-build-isolation -e ".[dev]"'
    else:
        install = PIP_EDITABLE
    return RepoSpec(test_cmd=PYTEST, parser="matplotlib", install=install)


def _seaborn(version: str) -> RepoSpec:
    install = PIP_EDITABLE if _v(version) < (0, 12) else "python -m pip install -e .[dev]"
    return RepoSpec(test_cmd="pytest --no-header -rA", parser="seaborn", install=install)


def _mypy(version: str) -> RepoSpec:
    cmd = "pytest -rA -k" if _v(version) >= (1, 7) else "pytest -n0 -rA -k"
    install = "python -m pip install -r test-requirements.txt; python -m pip install -e .; hash -r"
    return RepoSpec(test_cmd=cmd, directives="mypy", install=install)


_FIXED: dict[str, RepoSpec] = {
    # SWE-bench (full, Lite, Verified)
    "scikit-learn/scikit-learn": RepoSpec(
        test_cmd=PYTEST, parser="pytest_v2",
        install="python -m pip install -v --no-use-pep517 --no-build-isolation -e ."),
    "pallets/flask": RepoSpec(test_cmd=PYTEST, install=PIP_EDITABLE),
    "psf/requests": RepoSpec(test_cmd=PYTEST, parser="pytest_options", install="python -m pip install ."),
    "pytest-dev/pytest": RepoSpec(test_cmd=PYTEST, install=PIP_EDITABLE),
    "sphinx-doc/sphinx": RepoSpec(test_cmd="tox --current-env -epy39 -v --", parser="pytest_v2",
                                  install="python -m pip install -e .[test]"),
    "sympy/sympy": RepoSpec(test_cmd="PYTHONWARNINGS='ignore::UserWarning,ignore::SyntaxWarning' bin/test -C --verbose",
                            parser="sympy", install=PIP_EDITABLE),
    "pylint-dev/pylint": RepoSpec(test_cmd=PYTEST, parser="pytest_options", install=PIP_EDITABLE),
    "pydata/xarray": RepoSpec(test_cmd=PYTEST, install=PIP_EDITABLE),
    "sqlfluff/sqlfluff": RepoSpec(test_cmd=PYTEST, install=PIP_EDITABLE),
    "pyvista/pyvista": RepoSpec(test_cmd=PYTEST, install=PIP_EDITABLE),
    "pylint-dev/astroid": RepoSpec(test_cmd=PYTEST, install=PIP_EDITABLE),
    "marshmallow-code/marshmallow": RepoSpec(test_cmd=PYTEST, install="python -m pip install -e '.[dev]'"),
    "pvlib/pvlib-python": RepoSpec(test_cmd=PYTEST, install="python -m pip install -e .[all]"),
    "pydicom/pydicom": RepoSpec(test_cmd=PYTEST, parser="pytest_options", install=PIP_EDITABLE),
    # SWE-Gym
    "getmoto/moto": RepoSpec(test_cmd=PYTEST_N0, install="make init"),
    "conan-io/conan": RepoSpec(test_cmd=PYTEST_N0, eval_commands=("export PYTHONPATH=${PYTHONPATH:-}:$(pwd)",)),
    "dask/dask": RepoSpec(test_cmd="pytest -n0 -rA  --color=no", install="python -m pip install --no-deps -e ."),
    "project-monai/monai": RepoSpec(test_cmd="pytest -rA "),
    "iterative/dvc": RepoSpec(test_cmd=PYTEST),
    "bokeh/bokeh": RepoSpec(test_cmd="pytest -rA -n0"),
    "modin-project/modin": RepoSpec(test_cmd=PYTEST_N0),
    "hypothesisworks/hypothesis": RepoSpec(test_cmd="pytest -n0 -rA --tb=no --no-header"),
    "pydantic/pydantic": RepoSpec(test_cmd="pytest -rA --tb=short -vv -o console_output_style=classic --no-header",
                                  parser="pydantic"),
    "pandas-dev/pandas": RepoSpec(test_cmd="pytest -rA --tb=long"),
    "facebookresearch/hydra": RepoSpec(test_cmd="pytest -rA --tb=long"),
}
_BY_VERSION = {
    "django/django": _django,
    "astropy/astropy": _astropy,
    "matplotlib/matplotlib": _matplotlib,
    "mwaskom/seaborn": _seaborn,
    "python/mypy": _mypy,
}
SWEBENCH_REPOS = frozenset({
    "astropy/astropy", "django/django", "matplotlib/matplotlib", "mwaskom/seaborn", "pallets/flask",
    "psf/requests", "pydata/xarray", "pylint-dev/pylint", "pytest-dev/pytest", "scikit-learn/scikit-learn",
    "sphinx-doc/sphinx", "sympy/sympy", "sqlfluff/sqlfluff", "pyvista/pyvista", "pylint-dev/astroid",
    "marshmallow-code/marshmallow", "pvlib/pvlib-python", "pydicom/pydicom",
})


def repo_spec(repo: str, version: str = "") -> RepoSpec | None:
    """The spec of a repo a publisher lists (case-insensitive, as SWE-Gym's fork), else None."""
    key = repo.lower()
    if key in _BY_VERSION:
        return _BY_VERSION[key](version)
    return _FIXED.get(key)


def test_directives(repo: str, test_patch: str, style: str = "files") -> list[str]:
    """What the test command is given: the test patch's files, in SWE-bench's forms."""
    if style == "mypy":
        cases = re.findall(r"\[case ([^\]]+)\]", test_patch)
        return [shlex.quote(" or ".join(cases))]
    files = re.findall(r"diff --git a/.* b/(.*)", test_patch)
    files = [f for f in files if not f.endswith(NON_TEST_SUFFIXES)]
    if style == "django":
        files = [f.removesuffix(".py").removeprefix("tests/").replace("/", ".") for f in files]
    return files


def eval_script(spec: RepoSpec, repo: str, test_patch: str) -> str:
    """The bash script (one command a line, no `set -e`, stderr into stdout) that runs the tests."""
    test = " ".join([spec.test_cmd.rstrip(), *test_directives(repo, test_patch, spec.directives)])
    # one stream, as SWE-bench's log: runners print results on stderr, the markers on stdout
    lines = ["exec 2>&1", *CONDA_ACTIVATE, *spec.eval_commands, *([spec.install] if spec.install else []),
             f"echo '{START_TESTS}'", test, f"echo '{END_TESTS}'"]
    return "\n".join(lines)


def test_command(repo: str, version: str, test_patch: str) -> str:
    """The shell command a task from a published set runs its tests with ("" for other repos)."""
    spec = repo_spec(repo, version)
    if spec is None:
        return ""
    return "bash -c " + shlex.quote(eval_script(spec, repo, test_patch))
