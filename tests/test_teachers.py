"""Teachers: the plan a teacher derives from a task (edits from its patch, the symbol to search,
the call that shows the bug), each harness's demonstrations solving tasks through the real harness
CLI and proxy, and the warm start's cache key following what the teachers type."""

from __future__ import annotations

import msgspec
import pytest

from polar_fast.config import load_config
from polar_fast.rollouts.families import FAMILIES, family_task, family_tasks
from polar_fast.rollouts.tasks import load_builtin
from polar_fast.teachers import TeacherError, teacher_for
from polar_fast.teachers.moves import word_swap
from polar_fast.teachers.plan import fix_plan


def test_plan_of_a_family_task_reads_its_patch_and_statement():
    task = family_task("operator", 3)
    plan = fix_plan(task)
    [(path, old, new)] = plan.edits
    assert path == plan.path and old in plan.source and new not in plan.source
    assert plan.symbol in task.problem_statement and f"def {plan.symbol}(" in plan.source
    assert plan.call.startswith(f"{plan.symbol}(") and plan.call in task.problem_statement
    assert plan.module == plan.path[:-3].replace("/", ".")


def test_plan_of_a_builtin_task_with_a_pure_addition_anchors_on_context():
    lru = next(t for t in load_builtin() if t.instance_id.startswith("builtin__lru"))
    plan = fix_plan(lru)
    [(path, old, new)] = plan.edits
    assert new.startswith(old + "\n") and "move_to_end" in new and plan.source.count(old) == 1


def test_a_rename_is_one_word_swap_everywhere():
    plan = fix_plan(family_task("rename", 2))
    name, renamed = word_swap(plan)
    assert len(plan.edits) == 2 and all(name in old and renamed in new for _, old, new in plan.edits)
    assert word_swap(fix_plan(family_task("operator", 2))) is None


def _assert_the_short_search_shows_its_edit(task):
    """Runs the short form's grep in the task's repo: its output names the file the edit writes
    and holds every text the edit replaces."""
    import shlex
    import subprocess

    from polar_fast.teachers.moves import short_plan

    search, edit, plan = short_plan(fix_plan(task))
    shown = subprocess.run(search, shell=True, cwd=task.repo_snapshot, capture_output=True, text=True,
                           check=True).stdout
    swap = word_swap(plan) if ", -1)" in edit else None
    code = " ".join(shlex.split(edit))  # the python the shell runs
    for path, old, new in plan.edits:
        assert f"./{path}:" in shown and old.strip() in shown, (search, shown)
        replaced = swap[0] if swap else old  # a rename replaces the name everywhere in its file
        assert f"Path({path!r})" in code and repr(replaced) in code, edit
    return search, edit


@pytest.mark.parametrize("family", FAMILIES)
def test_the_short_search_shows_what_its_edit_copies(family):
    """The short form's premise: the policy's edit copies only what its one search showed; three
    calls, the submit alone (mini.yaml: "Do not combine it with any other command")."""
    import json

    from polar_fast.warm_start import check_lengths

    cfg = load_config("run.toml", ["warm_start.plan=short"])
    for seed in (0, 1, 2):
        task = family_task(family, seed)
        search, edit = _assert_the_short_search_shows_its_edit(task)
        replies = teacher_for("mini-swe-agent", "short").replies(task)
        commands = [json.loads(r.split("<tool_call>\n", 1)[1].split("\n</tool_call>")[0])["arguments"]["command"]
                    for r in replies]
        assert commands == [search, edit, "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"]
        check_lengths(cfg, {task.problem_statement: [replies]})  # the default cap holds every reply


def test_the_short_form_of_a_builtin_task_or_its_careful_steps():
    """A built-in task's edit either shows in one grep, or the teacher keeps the careful steps
    (leapyear's edit sits more than SHORT_CONTEXT_MAX lines below the function it names)."""
    from polar_fast.teachers.moves import short_plan

    builtin = {t.instance_id.split("-")[0]: t for t in load_builtin()}
    _assert_the_short_search_shows_its_edit(builtin["builtin__csvline"])
    leap = builtin["builtin__leapyear"]
    assert short_plan(fix_plan(leap)) is None
    assert teacher_for("mini-swe-agent", "short").steps(leap) == teacher_for("mini-swe-agent").steps(leap)
    with pytest.raises(TeacherError, match="warm_start.plan = 'brief' is not a teacher's form"):
        teacher_for("mini-swe-agent", "brief")


def test_unknown_harness_has_no_teacher():
    with pytest.raises(TeacherError, match="no teacher for harness 'codex'"):
        teacher_for("codex")


@pytest.mark.parametrize("harness", ["mini-swe-agent", "pi"])
def test_careful_demonstrations_read_before_they_write_and_fit_the_default_cap(harness):
    """The default run's cap holds every reply; the file is read before the edit that copies from
    it (the short form's search shows it instead: test_the_short_search_shows_what_its_edit_copies)."""
    from polar_fast.model import load_tokenizer
    from polar_fast.warm_start import check_lengths, demonstrations

    cfg = load_config("run.toml", [f"harness.name={harness}", "tasks.families=[]", "warm_start.plan=careful"])
    tasks = family_tasks("demos", per_family=8)
    plays = demonstrations(cfg, tasks)
    check_lengths(cfg, plays)  # raises when a reply would be cut at max_tokens
    tok = load_tokenizer()
    for task in tasks:
        replies = plays[task.problem_statement][0]
        plan = fix_plan(task)
        read = next(i for i, r in enumerate(replies) if plan.path in r and ("cat " in r or "nl -ba" in r
                                                                             or "sed -n" in r or '"read"' in r))
        edit = next(i for i, r in enumerate(replies) if plan.edits[0][2].strip() in r or "/g'" in r
                    or ".replace(" in r)
        assert read < edit, task.instance_id
        assert all(len(tok.encode(r)) < cfg.sampling.max_tokens for r in replies)


def test_cache_key_follows_the_demonstrations(monkeypatch):
    from polar_fast.warm_start import cache_key, demonstrations

    cfg = load_config("run.toml", ["tasks.families=[\"operator\"]", "warm_start.demos=2"])
    plays = demonstrations(cfg, family_tasks("demos", families=["operator"], per_family=2))
    edited = {k: [[*v[0][:-1], v[0][-1] + " "]] for k, v in plays.items()}
    assert cache_key(cfg, plays) == cache_key(cfg, dict(plays))
    assert cache_key(cfg, plays) != cache_key(cfg, edited)
    other = "float32" if cfg.learner.dtype == "bfloat16" else "bfloat16"  # run.toml's is bfloat16
    in_other = msgspec.structs.replace(cfg, learner=msgspec.structs.replace(cfg.learner, dtype=other))
    assert cache_key(cfg, plays) != cache_key(in_other, plays)  # sft in another precision: other weights


@pytest.mark.anyio
@pytest.mark.slow
@pytest.mark.parametrize("harness,form", [("mini-swe-agent", "careful"), ("pi", "careful"),
                                          ("mini-swe-agent", "short")])
async def test_each_teacher_solves_tasks_through_the_real_harness(harness, form, tmp_path):
    """The demonstrations, typed by a scripted engine through the real CLI and proxy in local
    sandboxes, pass their tasks' tests: one task of every family."""
    import anyio

    from polar_fast.engines.scripted import PlaybookEngine
    from polar_fast.evaluate import run_eval
    from polar_fast.model import load_tokenizer

    cfg = await anyio.to_thread.run_sync(lambda: load_config("run.toml", [
        f"harness.name={harness}", "tasks.families=[]", "warm_start.demos=1", "pools.group_size=1",
        "pools.agent_workers=4"]))
    teacher = teacher_for(harness, form)
    tasks = await anyio.to_thread.run_sync(lambda: family_tasks("demos", per_family=1))
    plays = await anyio.to_thread.run_sync(lambda: {t.problem_statement: [teacher.replies(t)] for t in tasks})
    tok = await anyio.to_thread.run_sync(load_tokenizer)
    demo_cfg = msgspec.structs.replace(cfg, tasks=msgspec.structs.replace(cfg.tasks, per_family=1))
    report = await run_eval(demo_cfg, split="demos", samples=1, ks=[1], run_dir=tmp_path / "demos",
                            engine_for=lambda c: PlaybookEngine(plays, tok))
    [scored] = report.harnesses
    assert scored.tasks == len(FAMILIES)
    assert [t.task_id for t in scored.per_task if not t.passed] == []
