"""What a person watching a run sees: a live status line and step bar while it runs, a summary
table at the end. Built on rich; disabled (quiet) it prints only the summary."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress
from rich.table import Table

from polar_fast.config import Config


class Progress:
    def __init__(self, cfg: Config, *, enabled: bool = True, console: Console | None = None) -> None:
        self.cfg = cfg
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
            self._steps = self._bar.add_task("steps", total=self.cfg.run.steps, detail="")
            self._status = self._bar.add_task("rollouts", total=None, detail="starting")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)

    def event(self, kind: str, data: dict[str, Any]) -> None:
        if kind == "info":
            self.console.log(data["message"]) if self.enabled else None
            return
        if self._bar is None:
            return
        if kind == "status":
            detail = (f"queued {data['queued']}  booting {data['booting']}  running {data['running']}  "
                      f"evaluating {data['evaluating']}  ready groups {data['groups_ready']}  "
                      f"policy v{data['version']}")
            self._bar.update(self._status, completed=data["rollouts_done"], detail=detail)
            self._bar.update(self._steps, completed=data["step"])
        elif kind == "step":
            self._bar.update(self._steps, completed=int(data["learner/step"]),
                             detail=f"reward {data['reward/mean']:.2f}  loss {data['learner/loss']:.4f}")

    def print_summary(self, summary) -> None:
        table = Table(title="polar_fast run summary")
        for col in ("step", "reward", "rollouts", "sampled tok", "forwarded tok", "per-call/merged",
                    "loss", "clip", "grad norm", "step s"):
            table.add_column(col, justify="right")
        for s in summary.steps:
            table.add_row(
                str(int(s["learner/step"])), f"{s['reward/mean']:.3f}", str(int(s["learner/n_rollouts"])),
                str(int(s["proxy/sampled_tokens"])), str(int(s["merge/tokens_forwarded"])),
                f"{s['merge/per_call_over_merged']:.2f}", f"{s['learner/loss']:.4f}",
                f"{s['learner/clip_frac']:.3f}", f"{s['learner/grad_norm']:.3f}", f"{s['step_time_s']:.1f}",
            )
        console = Console()
        console.print(table)
        outcomes = ", ".join(f"{k} {v}" for k, v in sorted(summary.outcomes.items())) or "none"
        console.print(f"outcomes: {outcomes}; groups trained {summary.groups_trained}, "
                      f"withheld as stale {summary.groups_withheld}; calls {summary.calls}, "
                      f"sampled tokens {summary.sampled_tokens}"
                      + ("; stopped early on request" if summary.stopped_early else ""))
        if summary.leftovers_removed:
            console.print(f"removed {summary.leftovers_removed} sandboxes left by an earlier run")
        console.print(f"checkpoint: {summary.checkpoint}")
