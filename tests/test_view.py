"""`python -m polar_fast view` on a run made here: the real training run (mini-swe-agent in a local
sandbox, real proxy, merge and learner; the model's choices scripted as in test_train.py), served
by the real command line and read in a real headless browser (Debian's chromium through
chromium-driver, installed by scripts/test.sh). Each page test leaves screenshots in its tmp_path.

The run re-renders every prompt (`proxy.history = "template"`), and the fixing rollout's first
reply carries reasoning, which SmolLM2's template drops when it renders that turn again: its second
prompt rewrites the first call's sampled answer, a real prefix break with a cause. The other
rollout's answer re-renders token for token, so it has no break.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import msgspec
import pytest
from test_train import SUBMIT, TASK, bash_call, fix_command, raw_config

from polar_fast.config import parse_config
from polar_fast.records import ExchangeRecord, Outcome, RecordLog, RunEndRecord, encode_frame, iter_frames, read_log
from polar_fast.report.view import browser
from polar_fast.report.view.browser import chromium, view_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

REPLIES = ["<think>The quoted-field test fails; I will apply the fix.</think>\n" + bash_call(fix_command(TASK.patch)),
           SUBMIT, bash_call("ls"), SUBMIT]


@pytest.fixture(scope="session")
def browser_required() -> None:
    if browser.browser_available():
        return
    if os.environ.get("CI") or os.environ.get("POLAR_REQUIRE_BROWSER"):
        pytest.fail("chromium and chromium-driver are missing (scripts/test.sh installs them)")
    pytest.skip("no chromium/chromium-driver: apt-get install -y chromium chromium-driver")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_model) -> Path:
    from polar_fast.train import train

    base = tmp_path_factory.mktemp("view")
    # the learner's model is the two-layer one with SmolLM2's tokenizer (conftest.tiny_model): the
    # pages show what the run recorded, which the scripted choices fix, not the weights
    cfg = parse_config(raw_config(base, replies=REPLIES, proxy={"history": "template"},
                                  model={"path": str(tiny_model)}))
    summary = asyncio.run(train(cfg))
    assert summary.steps and summary.steps[0]["outcomes/ok"] == 2
    return base / "run"


def wait_ready(driver, timeout_s: float = 240) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, timeout_s).until(lambda d: d.execute_script(
        "return document.body.dataset.ready || document.getElementById('error-title')"))
    assert driver.execute_script("return document.body.dataset.ready") == "1", driver.page_source[-2000:]


def css(driver, selector: str):
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, selector)


def wait_for(driver, selector: str, timeout_s: float = 120) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, timeout_s).until(lambda d: css(d, selector))


def read_calls(run: Path):
    by_rollout: dict[str, list] = {}
    for c in read_log(run / "records.log").calls:
        by_rollout.setdefault(c.rollout_id, []).append(c)
    return by_rollout


def reward_of(text: str) -> float | None:
    return None if text == "–" else float(text)


def fetch(url: str, **headers) -> tuple[int, str]:
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


# ----------------------------------------------------------------------------------- the views


def test_the_rollout_table_lists_every_rollout_with_its_reward(run_dir, browser_required, tmp_path):
    rollouts = read_log(run_dir / "records.log").rollouts
    with view_server(run_dir) as url, chromium() as d:
        d.get(url + "rollouts")
        wait_ready(d)
        d.save_screenshot(str(tmp_path / "rollouts.png"))
        shown = {tr.get_attribute("data-rollout-id"): reward_of(css(tr, "td.reward")[0].text)
                 for tr in css(d, "tr[data-rollout-id]")}
        assert shown == {r.rollout_id: r.reward for r in rollouts}  # the trained group, and what the end left in flight
        assert sorted(r for r in shown.values() if r is not None) == [0.0, 1.0]
        css(d, "th[data-sort=reward]")[0].click()  # ascending, then descending
        wait_for(d, "th.sorted.asc[data-sort=reward]")
        css(d, "th[data-sort=reward]")[0].click()
        wait_for(d, "th.sorted:not(.asc)[data-sort=reward]")
        first = [reward_of(td.text) for td in css(d, "tr[data-rollout-id] td.reward")]
        assert first[:2] == [1.0, 0.0] and set(first[2:]) <= {None}  # no reward (abandoned) sorts last both ways


@pytest.mark.parametrize("layout", ["tree", "paths"])
def test_a_rollouts_token_view_marks_exactly_the_sampled_tokens_as_trained(run_dir, browser_required, tmp_path, layout):
    calls = read_calls(run_dir)
    with view_server(run_dir) as url, chromium() as d:
        for rollout_id, mine in calls.items():
            d.get(f"{url}rollouts/{rollout_id}?layout={layout}")
            wait_ready(d)
            d.save_screenshot(str(tmp_path / f"{rollout_id}-{layout}.png"))
            assert css(d, "#tokens")[0].get_attribute("data-layout") == layout
            assert css(d, "#group-status")[0].get_attribute("data-trained") == "1"
            trained = css(d, ".tok.trained")
            # in the trie's order: call 0's sampled tokens, then call 1's; each exactly once
            assert [int(t.get_attribute("data-id")) for t in trained] == [i for c in mine for i in c.completion_ids]
            assert [int(t.get_attribute("data-call")) for t in trained] == [k for k, c in enumerate(mine)
                                                                               for _ in c.completion_ids]
            assert [float(t.get_attribute("data-logprob")) for t in trained] == pytest.approx(
                [p for c in mine for p in c.completion_logprobs], abs=1e-4)
            assert {t.get_attribute("data-version") for t in trained} == {"0"}
            assert len(css(d, ".tok[data-mask='1']")) == len(trained)  # no sampled token left untrained
            assert not css(d, ".tok.sampled-untrained")


def test_a_break_shows_where_the_prompt_left_the_trie_and_why(run_dir, browser_required, tmp_path):
    calls = read_calls(run_dir)
    broke = 0
    with view_server(run_dir) as url, chromium() as d:
        for rollout_id, (first, second) in calls.items():
            d.get(f"{url}rollouts/{rollout_id}?layout=tree")
            wait_ready(d)
            d.save_screenshot(str(tmp_path / f"{rollout_id}-break.png"))
            earlier = first.prompt_ids + first.completion_ids
            row = css(d, "#calls tr[data-call='1']")[0]
            if second.prompt_ids[: len(earlier)] == earlier:  # the re-render reproduced the answer
                assert not css(d, ".break") and "extends an earlier call" in row.text
                continue
            broke += 1
            [mark] = css(d, ".break")
            assert mark.get_attribute("data-cause") == "in_completion" and mark.get_attribute("data-call") == "1"
            assert "render:template" in mark.text
            assert "rewrite" in row.text and "in_completion" in row.text
            # the break sits where call 1's prompt first differs from call 0's prompt + answer
            lcp = next(i for i, (a, b) in enumerate(zip(second.prompt_ids, earlier)) if a != b)
            assert lcp >= len(first.prompt_ids)  # inside call 0's sampled answer
            after = d.execute_script("return arguments[0].nextElementSibling", mark)
            assert int(after.get_attribute("data-depth")) == lcp
            assert int(after.get_attribute("data-id")) == second.prompt_ids[lcp]
            assert after.get_attribute("data-mask") == "0"  # the rewritten text is prompt
    assert broke == 1  # the rollout whose first answer had reasoning: the template drops it


def test_the_plotted_values_equal_metrics_jsonl(run_dir, browser_required, tmp_path):
    metrics = {}  # (key, step) -> value; a step may have more than one line (a held-out eval writes its own)
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        metrics |= {(k, m["step"]): v for k, v in m.items() if k != "step"}
    with view_server(run_dir) as url, chromium() as d:
        d.get(url)
        wait_ready(d)
        d.save_screenshot(str(tmp_path / "run.png"))
        plotted = d.execute_script("""
            return [...document.querySelectorAll('#charts g[data-key] circle')].map(c =>
                [c.parentNode.dataset.key, +c.dataset.step, +c.dataset.value]);""")
        keys = {k for k, _, _ in plotted}
        for wanted in ("reward/mean", "reward/std", "pools/agent/busy_fraction", "pools/boot/queued",
                       "proxy/sampled_tokens", "merge/tokens_forwarded", "staleness/max",
                       "learner/clip_frac", "learner/ratio_mean", "learner/mismatch_kl", "learner/mismatch_abs_max"):
            assert wanted in keys
        assert len(plotted) == len({(k, s) for k, s, _ in plotted})
        for key, step, value in plotted:
            assert value == metrics[key, step], key
        outcomes = {tr.get_attribute("data-outcome"): int(tr.text.split()[-1]) for tr in css(d, "#outcomes tr[data-outcome]")}
        logged = [r.outcome.value for r in read_log(run_dir / "records.log").rollouts]
        assert outcomes == {o: logged.count(o) for o in logged} and outcomes["ok"] == 2
        assert json.loads(css(d, "#config")[0].get_attribute("textContent"))["proxy"]["history"] == "template"


def test_a_rollouts_sft_export_is_what_polar_fast_export_writes_for_it(run_dir, browser_required, tmp_path):
    from polar_fast.export import export_run

    export_run(run_dir, tmp_path / "sft", min_reward=0.0)
    exported = {name: [json.loads(line) for line in (tmp_path / "sft" / f"{name}.jsonl").read_text().splitlines()]
                for name in ("chat", "tokens")}
    with view_server(run_dir) as url, chromium() as d:
        for rollout_id in read_calls(run_dir):
            d.get(f"{url}rollouts/{rollout_id}")
            wait_ready(d)
            link = css(d, "#sft")[0].get_attribute("href")
            status, body = fetch(link)
            assert status == 200
            sft = json.loads(body)
            for name in ("chat", "tokens"):
                mine = [row for row in exported[name] if row["provenance"]["rollout_id"] == rollout_id]
                assert sft[name] == mine and mine


def copy_run(run_dir: Path, to: Path, *, reward: float | None = None) -> Path:
    """The run copied; with `reward`, every rollout record rewritten to it (a zero-variance group)."""
    shutil.copytree(run_dir, to)
    if reward is not None:
        records = [msgspec.structs.replace(r, reward=reward) if hasattr(r, "reward") else r
                   for r in read_log(to / "records.log").records]
        (to / "records.log").unlink()
        with RecordLog(to / "records.log") as log:
            log.append_all(records)
    return to


def test_zero_variance_withheld_and_interrupted_groups_say_they_did_not_train(run_dir, browser_required, tmp_path):
    flat = copy_run(run_dir, tmp_path / "flat", reward=1.0)
    stale = copy_run(run_dir, tmp_path / "stale")
    stopped = copy_run(run_dir, tmp_path / "stopped")
    [decision] = [json.loads(line) for line in (stale / "groups.jsonl").read_text().splitlines()]
    assert decision["status"] == "trained"  # what the real run wrote
    (stale / "groups.jsonl").write_text(json.dumps(decision | {"status": "withheld"}) + "\n")
    (stopped / "groups.jsonl").write_text(json.dumps(decision | {"status": "interrupted"}) + "\n")
    rollout_id = next(iter(read_calls(run_dir)))
    for run, words in ((flat, "zero-variance group"), (stale, "withheld"),
                       (stopped, f"the run was stopped during learner step {decision['step']}, before its update")):
        with view_server(run) as url, chromium() as d:
            d.get(f"{url}rollouts/{rollout_id}")
            wait_ready(d)
            d.save_screenshot(str(tmp_path / f"{run.name}.png"))
            status = css(d, "#group-status")[0]
            assert status.get_attribute("data-trained") == "0" and "did not train" in status.text and words in status.text
            sampled = sum(len(c.completion_ids) for c in read_calls(run)[rollout_id])
            assert len(css(d, ".tok.sampled-untrained")) == sampled and not css(d, ".tok.trained")


def test_the_run_says_how_it_ended_and_counts_the_learners_steps(run_dir, browser_required, tmp_path):
    """The run's end marker and its learner steps (an evaluation's metrics line is no step); the
    rollouts its end left in flight read `abandoned`, none `running`."""
    run = copy_run(run_dir, tmp_path / "copy")
    with (run / "metrics.jsonl").open("a") as f:  # the final held-out eval writes a line of its own
        f.write(json.dumps({"step": 1, "eval/pass@1": 0.5}) + "\n")
    contents = read_log(run / "records.log")
    end = contents.records[-1]
    assert isinstance(end, RunEndRecord) and end.reason == "finished: 1 of 1 steps done"
    abandoned = {r.rollout_id for r in contents.rollouts if r.outcome is Outcome.ABANDONED}
    assert end.abandoned == len(abandoned)
    with view_server(run) as url, chromium() as d:
        d.get(url)
        wait_ready(d)
        d.save_screenshot(str(tmp_path / "ended.png"))
        assert css(d, "h2")[0].text.startswith("Run: 1 step(s)")
        assert css(d, "#run-state")[0].text == "ended: finished: 1 of 1 steps done"
        d.get(url + "rollouts")
        wait_ready(d)
        outcomes = {tr.get_attribute("data-rollout-id"): css(tr, "td.outcome")[0].text for tr in css(d, "tr[data-rollout-id]")}
        assert {r for r, o in outcomes.items() if o == "abandoned"} == abandoned and "running" not in outcomes.values()


def test_a_killed_run_shows_its_unfinished_rollout_abandoned_once_no_process_holds_the_log(run_dir, browser_required, tmp_path):
    """The bytes a kill -9 leaves right after the first call: no end record and no run-end marker.
    While a process holds the log (a live run) the rollout is running; once none does, abandoned."""
    run = tmp_path / "killed"
    shutil.copytree(run_dir, run)
    data = (run / "records.log").read_bytes()
    cut = next(end for end, record in iter_frames(data) if isinstance(record, ExchangeRecord))
    (run / "records.log").write_bytes(data[:cut])
    for later in ("metrics.jsonl", "groups.jsonl"):  # written after the first step, which this run never reached
        (run / later).unlink()
    [rollout_id] = read_calls(run)
    with view_server(run) as url, chromium() as d:
        with RecordLog(run / "records.log"):  # a live writer
            d.get(f"{url}rollouts/{rollout_id}")
            wait_ready(d)
            assert css(d, "#outcome")[0].text == "running"
        d.refresh()  # the writer is gone and left no marker: killed or crashed
        wait_ready(d)
        d.save_screenshot(str(tmp_path / "killed.png"))
        assert css(d, "#outcome")[0].text == "abandoned"
        assert "without a run-end marker (killed or crashed)" in css(d, "#main")[0].text
        assert "did not train: the run ended before the group finished" in css(d, "#group-status")[0].text
        d.get(url)
        wait_ready(d)
        assert css(d, "#run-state")[0].text == "ended without a run-end marker: killed or crashed"


# ------------------------------------------------------------------------------------ bad input


def test_a_torn_tail_a_missing_metrics_file_and_an_unknown_rollout_give_clear_pages(run_dir, browser_required, tmp_path):
    run = tmp_path / "copy"
    shutil.copytree(run_dir, run)
    (run / "metrics.jsonl").unlink()
    contents = read_log(run / "records.log")
    extra = msgspec.structs.replace(contents.rollouts[0], rollout_id="late-rollout", group_id="late-group")
    frame = encode_frame(extra)
    with (run / "records.log").open("ab") as f:
        f.write(frame[: len(frame) // 2])  # a frame being written (or cut by a crash)
    with view_server(run) as url, chromium() as d:
        d.get(url)
        wait_ready(d)
        d.save_screenshot(str(tmp_path / "torn.png"))
        note = css(d, "#torn-note")[0].text
        assert "torn" in note and "cut short" in note
        assert "no metrics.jsonl" in css(d, "#notes")[0].text and css(d, "#no-metrics")
        d.get(url + "rollouts")
        wait_ready(d)
        listed = {tr.get_attribute("data-rollout-id") for tr in css(d, "tr[data-rollout-id]")}
        assert listed == {r.rollout_id for r in contents.rollouts}  # everything before the tail

        with (run / "records.log").open("ab") as f:  # the writer finishes the frame: a reload shows it
            f.write(frame[len(frame) // 2:])
        d.refresh()
        wait_ready(d)
        assert not css(d, "#torn-note")
        assert "late-rollout" in {tr.get_attribute("data-rollout-id") for tr in css(d, "tr[data-rollout-id]")}

        d.get(url + "rollouts/no-such-rollout")
        assert css(d, "#error-title")[0].text == "No rollout 'no-such-rollout' in this run"
        d.save_screenshot(str(tmp_path / "unknown.png"))
        assert fetch(url + "rollouts/no-such-rollout")[0] == 404
        status, body = fetch(url + "api/rollouts/no-such-rollout/tokens")
        assert status == 404 and "no-such-rollout" in json.loads(body)["error"]


def test_a_directory_that_holds_no_run_is_refused_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "polar_fast", "view", "--run", str(tmp_path), "--port", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "holds no run" in proc.stderr and "Traceback" not in proc.stderr


def test_a_non_loopback_bind_without_a_key_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    proc = subprocess.run([sys.executable, "-m", "polar_fast", "view", "--run", str(tmp_path), "--host", "0.0.0.0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--key" in proc.stderr and "Traceback" not in proc.stderr


def test_with_a_key_every_request_must_carry_it(run_dir, browser_required):
    with view_server(run_dir, "--key", "s3cret") as url:
        base = url.split("?")[0]
        assert url.endswith("?key=s3cret")
        assert fetch(base + "api/run")[0] == 401
        assert fetch(base + "api/run", Authorization="Bearer wrong")[0] == 401
        assert fetch(base + "api/run", Authorization="Bearer s3cret")[0] == 200
        with chromium() as d:
            d.get(url)  # the key becomes a cookie, and the address loses it
            wait_ready(d)
            assert "key=" not in d.current_url and css(d, "#charts g[data-key]")


def test_the_index_follows_a_growing_log_across_read_chunks(run_dir, monkeypatch, tmp_path):
    from polar_fast.report.view import run_data

    monkeypatch.setattr(run_data, "READ_CHUNK_BYTES", 997)  # frames straddle every chunk boundary
    data = (run_dir / "records.log").read_bytes()
    contents = read_log(run_dir / "records.log")
    (tmp_path / "records.log").write_bytes(data[: len(data) // 2])
    index = run_data.RunData(tmp_path)
    index.refresh()
    assert 0 < index.torn_bytes < len(data) // 2 and index.rollouts
    with (tmp_path / "records.log").open("ab") as f:  # the run appends the rest
        f.write(data[len(data) // 2:])
    index.refresh()
    assert index.torn_bytes == 0
    calls = read_calls(run_dir)
    assert {r.rollout_id: (r.reward, r.n_calls, r.sampled_tokens) for r in index.rollouts.values()} == {
        r.rollout_id: (r.reward, len(calls.get(r.rollout_id, [])),
                       sum(len(c.completion_ids) for c in calls.get(r.rollout_id, [])))
        for r in contents.rollouts}
    for rollout_id, mine in calls.items():
        assert index.rollout_records(rollout_id).calls == mine


# --------------------------------------------------------------------------------------- scale


def test_a_run_of_10k_rollouts_pages_without_loading_every_prompt(run_dir, browser_required, tmp_path):
    """5000 copies of the run's group (real records, renamed), then the table in the browser."""
    run = tmp_path / "big"
    run.mkdir()
    shutil.copy(run_dir / "config.json", run / "config.json")
    contents = read_log(run_dir / "records.log")
    group = contents.records[0].group_id  # the trained group: its two rollouts, 5000 times
    records = [r for r in contents.records if getattr(r, "group_id", None) == group]
    with RecordLog(run / "records.log") as log:
        for j in range(5000):
            log.append_all([msgspec.structs.replace(r, group_id=f"{r.group_id}-c{j}", rollout_id=f"{r.rollout_id}-c{j}",
                                                    **({"session_id": f"{r.session_id}-c{j}"} if hasattr(r, "session_id") else {}))
                            for r in records])
    log_bytes = (run / "records.log").stat().st_size
    with view_server(run) as url, chromium() as d:
        d.get(url + "rollouts")
        wait_ready(d, timeout_s=600)
        d.save_screenshot(str(tmp_path / "big.png"))
        info = css(d, "#page-info")[0]
        assert info.get_attribute("data-total") == "10000" and "1–50 of 10000" in info.text
        assert len(css(d, "tr[data-rollout-id]")) == 50
        css(d, "#next")[0].click()
        wait_for(d, "tr[data-rollout-id$='-c25']")  # page 2 in log order: copies 25 to 49
        assert "51–100 of 10000" in css(d, "#page-info")[0].text
        assert len(css(d, "tr[data-rollout-id]")) == 50
        fetched = d.execute_script("""return performance.getEntriesByType('resource')
            .filter(e => e.name.includes('/api/')).reduce((n, e) => n + e.transferSize, 0)""")
        assert 0 < fetched < 1_000_000 < log_bytes  # pages of rows, never the prompts
        prompt_text = read_log(run_dir / "records.log").exchanges[0].messages[-1].content[:60]
        assert prompt_text and prompt_text not in d.page_source
