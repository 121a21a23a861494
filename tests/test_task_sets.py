"""Published task sets load into the same Task: SWE-bench Verified (JSONL and parquet, test lists
JSON-encoded), SWE-Gym (parquet, lists), NovaSky-AI/SkyRL-v0-293-data (a Hub dir of split
parquet files with an `instance` struct). The rows are the hand-written fixtures in
tests/data/tasks (published shapes, invented commits and patches); the expected image names and
test commands are what SWE-bench's / SWE-Gym's / SkyRL's own code derives for those ids."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from polar_fast.rollouts.log_parsers import parse_log
from polar_fast.rollouts.task_images import (
    ImageMissingError,
    check_images,
    derive_image,
    swebench_image,
    swegym_image,
)
from polar_fast.rollouts.tasks import TaskError, load_tasks, parse_task
from polar_fast.rollouts.test_specs import CONDA_ACTIVATE, END_TESTS, START_TESTS

DATA = Path(__file__).parent / "data" / "tasks"


def script_of(task) -> list[str]:
    """The lines of the bash script a derived test command runs."""
    argv = shlex.split(task.test_command)
    assert argv[:2] == ["bash", "-c"], task.test_command
    return argv[2].split("\n")


def test_fixture_parquet_is_what_make_parquet_writes_from_the_json(tmp_path):
    """The shipped parquet files are generated from the hand-written JSON; keep them in sync."""
    skyrl = json.loads((DATA / "skyrl_v0_293.json").read_text())
    assert pq.read_table(DATA / "skyrl_v0_293" / "train.parquet").to_pylist() == skyrl["train"]
    assert pq.read_table(DATA / "swe_gym.parquet").to_pylist() == json.loads((DATA / "swe_gym.json").read_text())
    flat = [json.loads(line) for line in (DATA / "swebench_verified.jsonl").read_text().splitlines()]
    assert pq.read_table(DATA / "swebench_verified.parquet").to_pylist() == flat


@pytest.mark.parametrize("name", ["swebench_verified.jsonl", "swebench_verified.parquet"])
def test_swebench_verified_rows(name):
    tasks = {t.instance_id: t for t in load_tasks(str(DATA / name))}
    django, sympy, astropy = tasks["django__django-11099"], tasks["sympy__sympy-20590"], tasks["astropy__astropy-12907"]
    # JSON-encoded lists decoded
    assert django.FAIL_TO_PASS == ["test_ascii_validator (auth_tests.test_validators.UsernameValidatorsTests)",
                                   "test_unicode_validator (auth_tests.test_validators.UsernameValidatorsTests)"]
    assert sympy.PASS_TO_PASS == ["test__aresame", "test_structure"]
    # SWE-bench's remote image names: __ -> _1776_, lower case
    assert django.image == "swebench/sweb.eval.x86_64.django_1776_django-11099:latest"
    assert astropy.image == "swebench/sweb.eval.x86_64.astropy_1776_astropy-12907:latest"
    # test commands: conda env, eval commands, eval-time install, test command + directives
    lines = script_of(django)
    assert lines[:3] == ["exec 2>&1", *CONDA_ACTIVATE]
    assert "export LC_ALL=en_US.UTF-8" in lines and "python -m pip install -e ." in lines
    assert lines[-3:] == [f"echo '{START_TESTS}'",
                          "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1 auth_tests.test_validators",
                          f"echo '{END_TESTS}'"]
    assert script_of(sympy)[-2] == ("PYTHONWARNINGS='ignore::UserWarning,ignore::SyntaxWarning' bin/test -C --verbose "
                                    "sympy/core/tests/test_basic.py")
    assert script_of(astropy)[-2] == "pytest -rA astropy/modeling/tests/test_separable.py"
    assert "python -m pip install -e .[test] --verbose" in script_of(astropy)
    assert (django.log_parser, sympy.log_parser, astropy.log_parser) == ("django", "sympy", "pytest_v2")


def test_swe_gym_rows():
    tasks = {t.instance_id: t for t in load_tasks(str(DATA / "swe_gym.parquet"))}
    pandas, pydantic = tasks["pandas-dev__pandas-53122"], tasks["pydantic__pydantic-5506"]
    assert pandas.FAIL_TO_PASS == ["pandas/tests/frame/test_reductions.py::TestDataFrameAnalytics::test_idxmax_all_na"]
    # SWE-Gym's images: xingyaoww namespace, __ -> _s_
    assert pandas.image == "xingyaoww/sweb.eval.x86_64.pandas-dev_s_pandas-53122:latest"
    assert pydantic.image == "xingyaoww/sweb.eval.x86_64.pydantic_s_pydantic-5506:latest"
    # the .json data file is not a test directive; .rst is not on SWE-bench's list of non-test suffixes
    assert script_of(pandas)[-2] == ("pytest -rA --tb=long pandas/tests/frame/test_reductions.py "
                                     "doc/source/whatsnew/v2.1.0.rst")
    assert script_of(pydantic)[-2] == ("pytest -rA --tb=short -vv -o console_output_style=classic --no-header "
                                       "tests/test_main.py")
    assert pydantic.log_parser == "pydantic"


def test_skyrl_v0_293_rows_unwrap_the_instance_struct():
    train = {t.instance_id: t for t in load_tasks(str(DATA / "skyrl_v0_293"), split="train")}
    moto, mypy = train["getmoto__moto-7365"], train["python__mypy-15131"]
    assert moto.data_source == "swe-gym" and moto.repo == "getmoto/moto"
    assert moto.FAIL_TO_PASS == [
        "tests/test_dynamodb/test_dynamodb_update_expressions.py::test_update_different_map_elements_in_single_request"]
    assert moto.image == "xingyaoww/sweb.eval.x86_64.getmoto_s_moto-7365:latest"
    assert script_of(moto)[-2] == "pytest -n0 -rA tests/test_dynamodb/test_dynamodb_update_expressions.py"
    assert "make init" in script_of(moto)
    # the instance has no problem statement: the prompt column is the task
    assert mypy.problem_statement == "Crash on a dataclass with a field whose default is a lambda\n"
    # mypy: the test patch's [case ...] keys become one -k expression
    assert shlex.split(script_of(mypy)[-2]) == [
        "pytest", "-n0", "-rA", "-k", "testDataclassFieldLambdaDefault or testDataclassFieldLambdaDefaultNested"]
    (django,) = load_tasks(str(DATA / "skyrl_v0_293"), split="validation")
    assert django.data_source == "swe-bench"
    assert django.image == "swebench/sweb.eval.x86_64.django_1776_django-11099:latest"
    with pytest.raises(TaskError, match="no split 'test'; splits: train, validation"):
        load_tasks(str(DATA / "skyrl_v0_293"), split="test")


def test_same_task_from_all_three_shapes_is_the_same_task():
    (flat,) = [t for t in load_tasks(str(DATA / "swebench_verified.jsonl")) if t.instance_id == "django__django-11099"]
    row = json.loads((DATA / "swebench_verified.jsonl").read_text().splitlines()[0])
    lists = {**row, "FAIL_TO_PASS": json.loads(row["FAIL_TO_PASS"]), "PASS_TO_PASS": json.loads(row["PASS_TO_PASS"])}
    wrapped = {"prompt": row["problem_statement"], "data_source": "swe-bench", "ability": "coding", "instance": lists}
    as_instance_json = {**wrapped, "instance": json.dumps(lists)}  # copies of the set with the struct as a string
    for other in (parse_task(lists), parse_task(wrapped), parse_task(as_instance_json)):
        for field in ("instance_id", "FAIL_TO_PASS", "PASS_TO_PASS", "image", "test_command", "log_parser", "patch"):
            assert getattr(other, field) == getattr(flat, field), field


def test_chat_message_prompt_is_read_when_the_instance_has_no_statement():
    row = json.loads((DATA / "skyrl_v0_293.json").read_text())["train"][1]
    row["prompt"] = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "fix the crash"}]
    assert parse_task(row).problem_statement == "fix the crash"


def test_image_override_and_row_image():
    path = str(DATA / "swebench_verified.jsonl")
    tasks = load_tasks(path, image="sweb.eval.x86_64.{instance_id}:latest")  # SWE-bench's local build names
    assert tasks[0].image == "sweb.eval.x86_64.django__django-11099:latest"
    assert load_tasks(path, image="registry.local/{owner}/{name}:{version}")[0].image == "registry.local/django/django:3.0"
    row = json.loads(Path(path).read_text().splitlines()[0])
    assert parse_task({**row, "image_name": "mine/django:1"}).image == "mine/django:1"
    assert parse_task({**row, "image": "mine/django:2"}, image="forced:1").image == "forced:1"
    with pytest.raises(TaskError, match=r"row 1: tasks.image template .*'issue'"):
        load_tasks(path, image="x/{issue}:1")


def test_image_names_as_each_publisher_derives_them():
    assert swebench_image("pytest-dev__pytest-5103") == "swebench/sweb.eval.x86_64.pytest-dev_1776_pytest-5103:latest"
    assert swegym_image("Project-MONAI__MONAI-3403") == "xingyaoww/sweb.eval.x86_64.project-monai_s_monai-3403:latest"
    assert derive_image("Project-MONAI__MONAI-3403", "Project-MONAI/MONAI") == swegym_image("Project-MONAI__MONAI-3403")
    assert derive_image("x__y-1", "psf/requests", data_source="SWE-Gym") == swegym_image("x__y-1")
    assert derive_image("polar__calc-1", "polar/calc") == ""  # no publisher lists it: config / base image


BROKEN_ROWS = [
    (lambda r: {**r, "instance": {**r["instance"], "FAIL_TO_PASS": "oops"}}, r"row 2: field 'instance.FAIL_TO_PASS'"),
    (lambda r: {**r, "instance": {k: v for k, v in r["instance"].items() if k != "base_commit"}},
     r"row 2: field 'instance.base_commit': missing"),
    (lambda r: {**r, "instance": {**r["instance"], "PASS_TO_PASS": [1, 2]}}, r"row 2: field 'instance.PASS_TO_PASS\[0\]'"),
    (lambda r: {**r, "instance": 7}, r"row 2: field 'instance': expected a struct"),
    (lambda r: {**r, "instance": "{not json"}, r"row 2: field 'instance': not a JSON object"),
]


@pytest.mark.parametrize(("breaker", "message"), BROKEN_ROWS)
def test_broken_skyrl_row_names_row_and_field(tmp_path, breaker, message):
    rows = json.loads((DATA / "skyrl_v0_293.json").read_text())["train"]
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(rows[0]) + "\n" + json.dumps(breaker(rows[1])) + "\n")
    with pytest.raises(TaskError, match=message):
        load_tasks(str(path))


def test_broken_parquet_rows_name_row_and_field(tmp_path):
    rows = json.loads((DATA / "swe_gym.json").read_text())
    bad = [rows[0], {**rows[1], "FAIL_TO_PASS": []}]
    pq.write_table(pa.Table.from_pylist(bad), tmp_path / "gym.parquet")
    with pytest.raises(TaskError, match=r"gym.parquet: row 2: .*FAIL_TO_PASS is empty"):
        load_tasks(str(tmp_path / "gym.parquet"))
    flat = [json.loads(line) for line in (DATA / "swebench_verified.jsonl").read_text().splitlines()]
    flat[2]["PASS_TO_PASS"] = "[\"unterminated"
    pq.write_table(pa.Table.from_pylist(flat), tmp_path / "verified.parquet")
    with pytest.raises(TaskError, match=r"row 3: field 'PASS_TO_PASS': not a JSON list"):
        load_tasks(str(tmp_path / "verified.parquet"))


# ----------------------------------------------------------------------------- log parsing per repo

DJANGO_LOG = f"""\
Testing against Django installed in '/testbed/django'
{START_TESTS}
test_ascii_validator (auth_tests.test_validators.UsernameValidatorsTests) ... ok
test_unicode_validator (auth_tests.test_validators.UsernameValidatorsTests) ... FAIL
test_help_text (auth_tests.test_validators.MinimumLengthValidatorTest) ... skipped 'no'
test_slow (auth_tests.test_validators.MinimumLengthValidatorTest) ... printed by the test
ok
{END_TESTS}
test_after_the_end_marker (x.Y) ... ok
"""

SYMPY_LOG = """\
sympy/core/tests/test_basic.py[3]
test__aresame ok
test_structure ok
test_immutable F
________________________________ sympy/core/tests/test_basic.py:test_equality _________________________________
"""

PYTEST_LOG = """\
PASSED astropy/modeling/tests/test_separable.py::test_coord_matrix
FAILED astropy/modeling/tests/test_separable.py::test_separable[compound_model6-result6] - AssertionError: x
XFAIL astropy/modeling/tests/test_separable.py::test_known_bad - reason
ERROR tests/test_x.py::test_setup
"""


def test_parsers_read_ids_the_way_the_published_lists_name_them():
    django = parse_log("django", DJANGO_LOG)
    assert django == {
        "test_ascii_validator (auth_tests.test_validators.UsernameValidatorsTests)": "passed",
        "test_unicode_validator (auth_tests.test_validators.UsernameValidatorsTests)": "failed",
        "test_help_text (auth_tests.test_validators.MinimumLengthValidatorTest)": "skipped",
        "test_slow (auth_tests.test_validators.MinimumLengthValidatorTest)": "passed",
    }
    assert parse_log("sympy", SYMPY_LOG) == {"test__aresame": "passed", "test_structure": "passed",
                                              "test_immutable": "failed",
                                              "sympy/core/tests/test_basic.py:test_equality": "failed"}
    assert parse_log("pytest", PYTEST_LOG) == {
        "astropy/modeling/tests/test_separable.py::test_coord_matrix": "passed",
        "astropy/modeling/tests/test_separable.py::test_separable[compound_model6-result6]": "failed",
        "astropy/modeling/tests/test_separable.py::test_known_bad": "passed",  # XFAIL counts as a pass
        "tests/test_x.py::test_setup": "error",
    }
    coloured = "\x1b[32mPASSED\x1b[0m tests/a.py::t1\ntests/a.py::t2 FAILED\n"
    assert parse_log("pytest_v2", coloured) == {"tests/a.py::t1": "passed", "tests/a.py::t2": "failed"}
    assert parse_log("pydantic", "tests/test_main.py::t FAILED [ 50%]\n") == {"tests/test_main.py::t": "failed"}
    assert parse_log("pytest_options", "PASSED tests/t.py::test_f[/tmp/abc/data.txt]\n") == {
        "tests/t.py::test_f[/data.txt]": "passed"}
    assert parse_log("matplotlib", "PASSED lib/t.py::test_b[MouseButton.LEFT]\n") == {"lib/t.py::test_b[1]": "passed"}
    assert parse_log("seaborn", "tests/t.py::test_a PASSED [ 10%]\nFAILED tests/t.py::test_b\n") == {
        "tests/t.py::test_a": "passed", "tests/t.py::test_b": "failed"}
    # the default reading (built-in tasks) is the unittest/pytest one, unchanged
    assert parse_log("", "test_x (pkg.mod.Case.test_x) ... ok\n") == {"pkg.mod.Case.test_x": "passed"}
    with pytest.raises(ValueError, match="unknown log parser 'nose'"):
        parse_log("nose", "")


# ----------------------------------------------------------------------------- missing images

def test_missing_image_is_a_clear_error(docker_required):
    (task,) = [t for t in load_tasks(str(DATA / "swebench_verified.jsonl")) if t.instance_id == "sympy__sympy-20590"]
    with pytest.raises(ImageMissingError) as caught:
        check_images([task])
    message = str(caught.value)
    assert "'swebench/sweb.eval.x86_64.sympy_1776_sympy-20590:latest'" in message and "sympy__sympy-20590" in message
    assert "docker pull" in message and "docker load" in message and "tasks.image" in message
