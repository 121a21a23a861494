"""What a person watching a run sees: a live status line and step bar while it runs, a summary
table at the end. Built on rich; disabled (quiet) it prints only the summary."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress
from rich.table import Table

from polar_fast.report.intervals import paired_verdict


class Progress:
    def __init__(self, *, steps: int, enabled: bool = True, console: Console | None = None) -> None:
        self.steps = steps
        self.console = console or Console(stderr=True)
        self.enabled = enabled
        self._bar: RichProgress | None = None
        self._steps = None
        self._status = None

    def __enter__(self) -> Progress:
        if self.enabled:
            self._bar = RichProgress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[detail]}"), TimeElapsedColumn(), console=self.console,
            )
            self._bar.__enter__()
            self._steps = self._bar.add_task("steps", total=self.steps, detail="")
            self._status = self._bar.add_task("rollouts", total=None, detail="starting")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)

    def event(self, kind: str, data: dict[str, Any]) -> None:
        if kind == "info":
            self.console.log(data["message"]) if self.enabled else None
            return
        if kind == "eval":
            self.console.log(f"eval at step {data['step']}: {format_eval(data)}") if self.enabled else None
            return
        if self._bar is None:
            return
        if kind == "status":
            detail = (f"queued {data['queued']}  booting {data['booting']}  running {data['running']}  "
                      f"model calls {data.get('calls_in_flight', 0)}  evaluating {data['evaluating']}  ready groups {data['groups_ready']}  "
                      f"policy v{data['version']}")
            if data.get("waiting_for_disk"):
                detail += f"  [{data['waiting_for_disk']}]"
            self._bar.update(self._status, completed=data["rollouts_done"], detail=detail)
            self._bar.update(self._steps, completed=data["step"])
        elif kind == "step":
            causes = "  ".join(f"{k.rsplit('/', 1)[1]} {v:.0f}" for k, v in data.items()
                               if k.startswith("causes/") and v and not k.endswith("/zero_reward"))
            mismatch = (f"  mismatch kl {data['learner/mismatch_kl']:.1e} max|d| {data['learner/mismatch_abs_max']:.2f}"
                        if "learner/mismatch_kl" in data else "")
            self._bar.update(self._steps, completed=int(data["learner/step"]),
                             detail=f"reward {data['reward/mean']:.2f}  loss {data['learner/loss']:.4f}"
                                    + mismatch + (f"  {causes}" if causes else ""))

    def print_summary(self, summary, *, console: Console | None = None) -> None:
        console = console or Console()
        warm = getattr(summary, "warm_start", {})
        if warm:
            console.print(f"warm start{' (cached)' if warm.get('cached') else ''}: {warm['demos_kept']}/{warm['demos']} "
                          f"teacher demonstrations, sft nll {warm['nll_before']:.3f} -> {warm['nll_after']:.3f}")
        console.print(summary_table(summary.steps, width=console.width))
        if line := reward_line(summary.steps):
            console.print(line)
        outcomes = ", ".join(f"{k} {v}" for k, v in sorted(summary.outcomes.items())) or "none"
        console.print(f"outcomes: {outcomes}; groups trained {summary.groups_trained}, "
                      f"withheld as stale {summary.groups_withheld}; calls {summary.calls}, "
                      f"sampled tokens {summary.sampled_tokens}"
                      + ("; stopped early on request" if summary.stopped_early else ""))
        evals = getattr(summary, "evals", [])
        for entry in evals:
            console.print(f"eval at step {entry['step']}: {format_eval(entry)}")
        if line := before_after(evals):
            console.print(line)
        causes = getattr(summary, "causes", {})
        for harness, counts in sorted(causes.items()):  # zero_reward: rollouts; the rest: calls
            named = ", ".join(f"{c} {n}" for c, n in counts.items() if n) or "none"
            console.print(f"{harness} zero rewards and their causes: {named}")
        if summary.leftovers_removed:
            console.print(f"removed {summary.leftovers_removed} sandboxes left by an earlier run")
        console.print(f"checkpoint: {summary.checkpoint}")


def before_after(evals: list[dict]) -> str:
    """'heldout pass@1: 35.7% at the start (the policy RL began from) -> 42.9% after step 2 (+7.1
    points, 95% paired interval over 14 tasks x 1 [-7.1, +21.4], sign-flip p 0.63: within noise)', when the
    run evaluated its starting policy and a later one on the same tasks (intervals.paired_verdict)."""
    first = next((e for e in evals if e["step"] == 0), None)
    last = evals[-1] if evals else None
    if first is None or last is first or first["pass_at"].get("1") is None or last["pass_at"].get("1") is None:
        return ""
    a, b = first["pass_at"]["1"], last["pass_at"]["1"]
    line = (f"{first['split']} pass@1: {100 * a:.1f}% at the start (the policy RL began from) -> {100 * b:.1f}% "
            f"after step {last['step']} ({100 * (b - a):+.1f} points")
    before, after = first.get("per_task") or {}, last.get("per_task") or {}
    ids = sorted(set(before) & set(after))
    if not ids:
        return line + f"; {last['tasks']} {last['split']} tasks x {last['samples']})"
    lo, hi, p, verdict = paired_verdict([before[i] for i in ids], [after[i] for i in ids])
    return (line + f", 95% paired interval over {len(ids)} tasks x {last['samples']}"
            f" [{100 * lo:+.1f}, {100 * hi:+.1f}], sign-flip p {p:.2f}: {verdict})")


SPARKS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], low: float = 0.0, high: float = 1.0) -> str:
    """One block character per value on a fixed [low, high] scale (a reward in [0, 1] by default),
    so two runs' lines compare by eye."""
    span = (high - low) or 1.0
    return "".join(SPARKS[min(len(SPARKS) - 1, max(0, int((v - low) / span * len(SPARKS))))] for v in values)


def reward_line(steps: list[dict]) -> str:
    """'train reward per step: ▂▃▅▆ 0.25 0.38 0.62 0.75' (every finished group's mean, skipped ones too)."""
    rewards = [s["reward/mean"] for s in steps if "reward/mean" in s]
    if not rewards:
        return ""
    return "train reward per step: " + sparkline(rewards) + "  " + " ".join(f"{r:.2f}" for r in rewards)


def format_eval(entry: dict) -> str:
    """'pass@1 41.7% (12 heldout tasks x 1), mean reward 0.417'"""
    cells = ", ".join(f"pass@{k} {'n<k' if v is None else f'{100 * v:.1f}%'}" for k, v in entry["pass_at"].items())
    reward = entry.get("mean_reward")
    return (f"{cells} ({entry['tasks']} {entry['split']} tasks x {entry['samples']})"
            + (f", mean reward {reward:.3f}" if reward is not None else ""))


# (header, metrics key, format), most important first: a narrow terminal keeps a prefix of these
SUMMARY_COLUMNS = [
    ("step", "learner/step", "{:.0f}"),
    ("reward", "reward/mean", "{:.3f}"),
    ("rollouts", "learner/n_rollouts", "{:.0f}"),
    ("sampled\ntokens", "proxy/sampled_tokens", "{:.0f}"),
    ("forwarded\ntokens", "merge/tokens_forwarded", "{:.0f}"),
    ("loss", "learner/loss", "{:.4f}"),
    ("grad\nnorm", "learner/grad_norm", "{:.3f}"),
    ("step s", "step_time_s", "{:.1f}"),
    ("per-call /\nmerged", "merge/per_call_over_merged", "{:.2f}"),
    ("clip", "learner/clip_frac", "{:.3f}"),
    ("mismatch\nkl", "learner/mismatch_kl", "{:.1e}"),
    ("reward\nstd", "reward/std", "{:.3f}"),
    ("zero-var\ngroups", "reward/zero_variance_groups", "{:.0f}"),
    ("max\nstaleness", "staleness/max", "{:.0f}"),
]


def summary_table(steps: list[dict], *, width: int) -> Table:
    """The per-step table, with as many columns as fit in `width` characters, never cut cells."""
    cells = [[fmt.format(s[key]) if key in s else "-" for _, key, fmt in SUMMARY_COLUMNS] for s in steps]
    chosen, used = [], 1
    for i, (header, _, _) in enumerate(SUMMARY_COLUMNS):
        need = max([len(line) for line in header.split("\n")] + [len(row[i]) for row in cells]) + 3
        if used + need > width and chosen:
            break
        chosen.append(i)
        used += need
    table = Table(title="polar_fast run summary")
    for i in chosen:
        table.add_column(SUMMARY_COLUMNS[i][0], justify="right", no_wrap=True)
    for row in cells:
        table.add_row(*(row[i] for i in chosen))
    return table
