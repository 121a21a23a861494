"""Regenerates bench/data/captured/: real sessions of the five harness CLIs, captured by the proxy.

Each harness CLI runs on this host (private HOME, its adapter's command) against the real capture
proxy, whose engine is scripted: the model's choices are the only test double. Per harness, one
group of ROLLOUTS rollouts (one proxy session each, group_id = the harness) on one small real task:
write fizzbuzz.py, run it, inspect it a varying number of times, answer. The rollouts differ as a
GRPO group's samples would: a different first reply (the FizzBuzz range), a different number of
tool steps. In the compacting harnesses (claude-code, codex, qwen-code, pi; told a small window as
tests/test_harness_compaction.py does) half the rollouts then print ~3k tokens per step until the
harness compacts on its own; after the summary they take one more step and answer. In Claude Code
and Qwen Code two rollouts hand an inspection to a sub-agent through the harness's own agent tool;
it runs in the background, so its calls interleave with the main loop's in the same session (how
they interleave depends on timing: a rerun may differ by a call there).

What ships: `<harness>.log.gz`, the proxy's record log with only the CallRecords (as the proxy
wrote them, prompt deltas included; timings zeroed so reruns differ only where the CLIs' prompts
do, e.g. the date), and meta.json (the tokenizer's end-of-turn id, per-rollout facts). The bench
reads them through polar_fast.records (support/captured.py), never this script or tests/.

    .venv/bin/python bench/support/capture_sessions.py [--only NAME ...]

Reuses the harness test machinery in tests/ (run_on_host, the tool tables, the summary prompts).
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import shutil
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import msgspec

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))  # the harness test helpers; only this script needs them

from harness_run import run_on_host  # noqa: E402
from test_harness_compaction import (  # noqa: E402
    CONTEXT_TOKENS,
    MAX_OUTPUT_TOKENS,
    SUMMARY_MARK,
    SUMMARY_PROMPTS,
    USER_TURN,
)
from test_harness_proxy import MODEL, TOOLS, hermes  # noqa: E402

from polar_fast.engines import Generation, Sampling  # noqa: E402
from polar_fast.engines.scripted import ScriptedEngine, scripted_generation  # noqa: E402
from polar_fast.model import load_tokenizer, resolve_model_path  # noqa: E402
from polar_fast.records import CallRecord, RecordLog, Timings, read_log  # noqa: E402
from polar_fast.rollouts.harnesses import HARNESSES, ModelLimits, default_bundle_root, get_harness  # noqa: E402
from polar_fast.testing import scripted_proxy  # noqa: E402

OUT = ROOT / "bench" / "data" / "captured"
WORK = Path("/tmp/polar_fast_capture")  # fixed paths: the CLIs write cwd into their prompts
ROLLOUTS = 6
TOOL_TURN = f"{USER_TURN}<tool_response>"  # one per step (parallel results share a turn)
TASK_PHRASE = "that prints FizzBuzz from 1 to"  # only in the main loop's user turn
SUB_MARK = "POLAR-SUBAGENT"
MAX_PAD_STEPS = 14  # padding steps before giving up on a compaction
RUN_TIMEOUT_S = 240.0
NO_COMPACTION = 1_000_000  # mini-swe-agent never compacts: serve a window it cannot outgrow
SUBAGENT_TOOL = {"claude-code": "Agent", "qwen-code": "agent"}  # their sub-agent tools, as offered
INSPECT = ["wc -l fizzbuzz.py", "python3 fizzbuzz.py | grep -c Fizz", "ls -la", "head -n 2 fizzbuzz.py"]


@dataclass(frozen=True)
class Variation:
    """One rollout's choices: FizzBuzz range, inspection steps, padding to compaction, sub-agent."""

    upto: int
    inspect: int
    pad: bool
    subagent: bool
    pad_lines: int = 180


def variations(name: str) -> list[Variation]:
    compacts = name in SUMMARY_PROMPTS
    sub = name in SUBAGENT_TOOL
    return [Variation(upto=(15, 20, 30)[i % 3], inspect=i % 3 + (0 if compacts else i // 3),
                      pad=compacts and i >= ROLLOUTS // 2, subagent=sub and i in (1, 2),
                      pad_lines=160 + 20 * (i % 3)) for i in range(ROLLOUTS)]


def pad_command(step: int, lines: int) -> str:  # ~17 tokens a line
    return (f"for i in $(seq 1 {lines}); do echo \"step {step} line $i: the quick brown fox jumps "
            "over the lazy dog\"; done")


def fizzbuzz(upto: int) -> str:  # no single quotes: codex and mini-swe-agent write it with printf '...'
    return (f"for i in range(1, {upto + 1}):\n"
            "    print(\"FizzBuzz\" if i % 15 == 0 else \"Fizz\" if i % 3 == 0 else \"Buzz\" if i % 5 == 0 else i)\n")


class CaptureEngine:
    """Scripted engine (the model's choices): replies picked by the prompt, so side calls, the
    summary request and the sub-agent's calls all get the reply their place calls for."""

    def __init__(self, tokenizer, name: str, task: Path) -> None:
        self.policy_version = 0
        self.tokenizer, self.name, self.task = tokenizer, name, task
        self.variation = Variation(upto=15, inspect=0, pad=False, subagent=False)
        self.kinds: list[str] = []  # per call of the current rollout

    def _final(self, text: str) -> str:
        if self.name == "mini-swe-agent":  # it ends only through its bash tool printing the marker
            return hermes(TOOLS[self.name].shell("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"), text="Submitting.")
        return text

    def _main(self, steps: int) -> tuple[str, str]:
        v, tools = self.variation, TOOLS[self.name]
        plan = [hermes(tools.write(self.task / "fizzbuzz.py", fizzbuzz(v.upto)), text="I'll write the script.",
                       think=f"FizzBuzz up to {v.upto}: one loop with the three cases.")]
        plan.append(hermes(tools.shell("python3 fizzbuzz.py"), text="Running it."))
        if v.subagent:
            task = {"description": "Check fizzbuzz.py", "subagent_type": "general-purpose",
                    "prompt": f"{SUB_MARK}: count the lines of fizzbuzz.py in {self.task} and report."}
            plan.append(hermes((SUBAGENT_TOOL[self.name], task), text="A sub-agent checks the file."))
        plan += [hermes(tools.shell(c), text="Inspecting.") for c in INSPECT[: v.inspect]]
        if steps < len(plan):
            return "main", plan[steps]
        if v.pad and steps < len(plan) + MAX_PAD_STEPS:
            return "pad", hermes(tools.shell(pad_command(steps, v.pad_lines)), text="Printing more.")
        return "final", self._final(f"Done: fizzbuzz.py prints FizzBuzz up to {v.upto}.")

    def _reply(self, text: str) -> tuple[str, str]:
        last_user = text[text.rfind(USER_TURN):] if USER_TURN in text else text
        if any(p in last_user for p in SUMMARY_PROMPTS.get(self.name, ())):
            return "summary", (f"<summary>\n<state_snapshot>\n{SUMMARY_MARK}: fizzbuzz.py up to {self.variation.upto} "
                               "is written and runs; padding printed.\n</state_snapshot>\n</summary>")
        if SUB_MARK in text and TASK_PHRASE not in text:  # the sub-agent's own loop
            if text.count(TOOL_TURN) == 0:
                return "sub", hermes(TOOLS[self.name].shell(f"wc -l {self.task}/fizzbuzz.py"), text="Counting.")
            return "sub-final", "fizzbuzz.py has 2 lines: a loop and one print."
        if SUMMARY_MARK in text:  # compacted: one more step, then the answer
            after = text[text.rfind(SUMMARY_MARK):]
            if after.count(TOOL_TURN) == 0:
                return "after", hermes(TOOLS[self.name].shell("python3 fizzbuzz.py | tail -n 3"), text="Re-checking.")
            return "final", self._final("Done: fizzbuzz.py is written and checked.")
        return self._main(text.count(TOOL_TURN))

    async def generate(self, prompt_ids: Sequence[int], sampling: Sampling, *, session_id: str = "") -> Generation:
        text = await asyncio.to_thread(self.tokenizer.decode, list(prompt_ids))
        kind, reply = self._reply(text)
        self.kinds.append(kind)
        return scripted_generation(ScriptedEngine._to_ids(reply, self.tokenizer), sampling)

    async def update_weights(self, named_tensors, *, version: int) -> None:
        self.policy_version = version

    async def aclose(self) -> None:
        pass


def fresh_dirs(name: str, i: int) -> tuple[Path, Path]:
    home, task = WORK / name / f"r{i}" / "home", WORK / name / f"r{i}" / "task"
    shutil.rmtree(home.parent, ignore_errors=True)
    home.mkdir(parents=True), task.mkdir()
    return home, task


async def capture(name: str, tokenizer, work: Path) -> dict:
    """Run the harness's group; write its calls; return what meta.json says about it."""
    bundle = get_harness(name).install(default_bundle_root())
    context = CONTEXT_TOKENS.get(name, NO_COMPACTION)
    config = {"model": {"max_context_tokens": context}, "sampling": {"max_tokens": MAX_OUTPUT_TOKENS}}
    limits = ModelLimits(context_tokens=context, max_output_tokens=MAX_OUTPUT_TOKENS)
    rollouts = []
    await asyncio.to_thread(shutil.rmtree, work, True)  # the proxy appends to an existing log
    async with scripted_proxy(work, engine=CaptureEngine(tokenizer, name, WORK), config=config) as px:
        for i, v in enumerate(variations(name)):
            home, task = await asyncio.to_thread(fresh_dirs, name, i)
            px.engine.task, px.engine.variation, px.engine.kinds = task, v, []
            token = await px.new_session(f"{name}-r{i}", name)
            cmd = get_harness(name).command(
                prompt=f"Write fizzbuzz.py {TASK_PHRASE} {v.upto}, run it and check its output.",
                proxy_url=f"{px.root_url}/s/{token}", api_key=token, model=MODEL, home=str(home),
                bundle=str(bundle), max_steps=MAX_PAD_STEPS + 12, limits=limits)
            code, output = await run_on_host(cmd, home=home, cwd=task, timeout_s=RUN_TIMEOUT_S)
            kinds = px.engine.kinds
            print(f"  {name} r{i} exit {code}, {len(kinds)} calls: {' '.join(kinds)}", flush=True)
            if code != 0:
                raise RuntimeError(f"{name} rollout {i} exited {code}:\n{output[-3000:]}")
            rollouts.append(asdict(v) | {"calls": len(kinds), "compacted": "summary" in kinds,
                                         "subagent_calls": sum(k.startswith("sub") for k in kinds)})
    contents = await asyncio.to_thread(read_log, px.log_path)
    calls = [msgspec.structs.replace(r, timings=Timings()) for r in contents.records if isinstance(r, CallRecord)]
    tools = next((sorted(t.name for t in e.tools) for e in contents.exchanges if e.tools), [])
    path = OUT / f"{name}.log.gz"
    await asyncio.to_thread(write_calls, path, calls, work)
    return {"file": path.name, "bytes": path.stat().st_size, "calls": len(calls), "rollouts": rollouts,
            "first_request_tools": tools}


def write_calls(path: Path, calls: list[CallRecord], work: Path) -> None:
    raw = work / f"{path.stem}.raw"
    raw.unlink(missing_ok=True)
    with RecordLog(raw) as log:
        log.append_all(calls)
    path.write_bytes(gzip.compress(raw.read_bytes(), compresslevel=9, mtime=0))  # mtime=0: same input, same bytes


async def main(only: list[str]) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    tokenizer = await asyncio.to_thread(load_tokenizer, "")
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert eot == tokenizer.eos_token_id, "the scripted replies end with eos: it must be the end of turn"
    meta_path = OUT / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {"harnesses": {}}
    meta |= {"tokenizer": resolve_model_path("").name, "eot_id": eot, "rollouts": ROLLOUTS}
    for name in only or sorted(HARNESSES):
        print(f"capturing {name}", flush=True)
        work = WORK / name
        meta["harnesses"][name] = await capture(name, tokenizer, work)
        h = meta["harnesses"][name]
        print(f"wrote {OUT / h['file']}: {h['calls']} calls, {h['bytes']} bytes", flush=True)
        meta_path.write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
    print(f"wrote {meta_path}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="*", default=[], choices=sorted(HARNESSES), help="harnesses to recapture")
    asyncio.run(main(parser.parse_args().only))
