"""The command line. Parses arguments, loads the config once, runs one coroutine on uvloop.

    python -m polar_fast --config run.toml [--resume] [--set section.key=value ...]   # train
    torchrun --nproc_per_node N -m polar_fast --config run.toml ...   # learner on N GPUs (FSDP2)
    python -m polar_fast serve --config run.toml [--host H] [--port P] [--rollouts]
    python -m polar_fast eval --config run.toml [--checkpoint PATH] [--harness a,b] [--samples N] [--k 1,5] [--guided]
    python -m polar_fast export --run runs/default --out sft/ [--min-reward 1.0]
    python -m polar_fast export-model --config run.toml --checkpoint runs/default/checkpoints --out DIR
    python -m polar_fast check --config run.toml   # preflight: exits 1 when an item fails
    python -m polar_fast view --run runs/default [--port P] [--host H --key SECRET]
    python -m polar_fast sft --config run.toml --data sft/ [--out DIR] [--epochs N] [--lr X]
    python -m polar_fast harnesses install [NAMES...|--all] [--bundle-root DIR]
    python -m polar_fast harnesses check NAME|FILE [--config run.toml] [--json PATH]   # exits 1 when a line fails
    python -m polar_fast tasks validate SOURCE [--config run.toml] [--split S] [--limit N] [--json PATH]

Errors a user can fix (bad config, output dir in use, missing model) print one line and exit 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import uvloop

from polar_fast.config import Config, load_config
from polar_fast.errors import PolarError

COMMANDS = ("train", "serve", "eval", "export", "export-model", "check", "sft", "view", "harnesses", "tasks")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m polar_fast", description="Agentic RL on unmodified coding harnesses.")
    sub = p.add_subparsers(dest="command")
    train = sub.add_parser("train", help="the training run (default command)")
    serve = sub.add_parser("serve", help="the capture proxy alone, for collecting traces by hand")
    export = sub.add_parser("export", help="test-verified sessions of a run as SFT data")
    evaluate = sub.add_parser("eval", help="pass@k per harness on a task split, for the base model or a checkpoint")
    sft = sub.add_parser("sft", help="fine-tune the model on token rows written by export")
    export_model = sub.add_parser("export-model", help="a learner checkpoint as an HF model directory")
    check = sub.add_parser("check", help="preflight before a (GPU) run: config, tasks, engine, learner memory, disk")
    for q in (train, serve, evaluate, sft, export_model, check):
        q.add_argument("--config", type=Path, help="run.toml (defaults apply to anything it leaves out)")
        q.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="override one config value; repeatable")
    train.add_argument("--resume", action="store_true", help="continue the run in run.output_dir")
    train.add_argument("--quiet", action="store_true", help="no progress display, only the summary")
    serve.add_argument("--host", help="listen address (default: proxy.host)")
    serve.add_argument("--port", type=int, help="listen port (default: proxy.port, 0 = any free port)")
    serve.add_argument("--rollouts", action="store_true",
                       help="serve the rollout-service API for external trainers instead of the bare proxy "
                            "([rollout_service] host/port; the proxy runs behind it)")
    evaluate.add_argument("--checkpoint", default="",
                          help="a learner checkpoint (step_N.pt or its checkpoints/ dir) or an HF model dir; "
                               "default: model.path")
    evaluate.add_argument("--harness", default="", help="comma-separated harnesses (default: eval.harnesses or harness.name)")
    evaluate.add_argument("--samples", type=int, default=None, help="samples per task (default: eval.samples)")
    evaluate.add_argument("--k", default="", help="comma-separated k for pass@k (default: eval.k)")
    evaluate.add_argument("--split", default=None, help="task split (default: eval.split)")
    evaluate.add_argument("--limit", type=int, default=None, help="tasks of the split (default: eval.limit, 0 = all)")
    evaluate.add_argument("--out", type=Path, default=None, help="JSON report (default: <run.output_dir>/eval/<split>.json)")
    evaluate.add_argument("--guided", action="store_true",
                          help="guide each rollout as [guide] guides training (validation only: held-out is never guided)")
    sft.add_argument("--data", type=Path, required=True, help="export's output dir (tokens.jsonl) or a .jsonl file")
    sft.add_argument("--out", type=Path, default=None, help="model directory to write (default: <run.output_dir>/sft)")
    sft.add_argument("--epochs", type=int, default=None, help="default: sft.epochs")
    sft.add_argument("--lr", type=float, default=None, help="default: sft.lr")
    export_model.add_argument("--checkpoint", required=True,
                              help="a learner checkpoint step_N.pt, or a checkpoints/ dir (its latest)")
    export_model.add_argument("--out", type=Path, required=True,
                              help="model directory to write (safetensors, config, tokenizer of model.path)")
    check.add_argument("--nproc-per-node", type=int, default=0,
                       help="learner ranks under torchrun (default: the GPUs in CUDA_VISIBLE_DEVICES, else 1)")
    export.add_argument("--run", type=Path, required=True, help="a run's output_dir (holds records.log)")
    export.add_argument("--out", type=Path, required=True, help="directory for the exported files")
    export.add_argument("--min-reward", type=float, default=1.0, help="keep rollouts with reward >= this")
    view = sub.add_parser("view", help="a local web page of a run's curves, rollouts and tokens")
    view.add_argument("--run", type=Path, required=True, help="a run's output_dir (records.log, metrics.jsonl)")
    view.add_argument("--host", default="127.0.0.1", help="listen address; anything but loopback needs --key")
    view.add_argument("--port", type=int, default=8765, help="listen port (0 = any free port)")
    view.add_argument("--key", default="", help="a secret every request must carry (required off loopback)")
    harnesses = sub.add_parser("harnesses", help="the harness CLI bundles")
    harness_sub = harnesses.add_subparsers(dest="harness_command", required=True)
    install = harness_sub.add_parser("install", help="build and cache harness bundles; prints `name path` per bundle")
    install.add_argument("names", nargs="*", help="harnesses: mini-swe-agent, codex, claude-code, qwen-code, pi, or a definition file")
    install.add_argument("--all", action="store_true", help="every harness")
    install.add_argument("--bundle-root", type=Path, default=None, help="default ~/.cache/polar_fast/harnesses")
    check = harness_sub.add_parser("check", help="does a harness train exactly? runs it through the proxy with a "
                                   "scripted model; exits 1 when a line fails")
    check.add_argument("target", help="a harness name, or a TOML file declaring one (docs/harnesses.md)")
    check.add_argument("--config", type=Path, help="run.toml: its model, [sampling], [sandbox], [harness]")
    check.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    check.add_argument("--json", type=Path, default=None, help="also write the report here")
    tasks = sub.add_parser("tasks", help="task sets")
    tasks_sub = tasks.add_subparsers(dest="tasks_command", required=True)
    validate = tasks_sub.add_parser("validate", help="run each task's reference patch (must pass) and the empty "
                                                     "patch (must fail) in sandboxes; report the tasks that do not hold")
    validate.add_argument("source", help="builtin, a .jsonl / .parquet file or a datasets dir (as tasks.source)")
    validate.add_argument("--config", type=Path, help="run.toml: [sandbox], tasks.image and pools.eval_timeout_s")
    validate.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    validate.add_argument("--split", default=None, help="split of a datasets dir (default: tasks.split)")
    validate.add_argument("--limit", type=int, default=0, help="check only the first N tasks")
    validate.add_argument("--workers", type=int, default=2, help="sandboxes at once")
    validate.add_argument("--json", type=Path, default=None, help="also write the per-task results here")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS + ("-h", "--help"):
        argv.insert(0, "train")
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "harnesses" and args.harness_command == "check":
            return _check_harness(load_config(args.config, args.overrides), args.target, args.json)
        if args.command == "harnesses":
            return _install_harnesses(parser, args.names, every=args.all, bundle_root=args.bundle_root)
        if args.command == "export":
            from polar_fast.export import export_run

            report = export_run(args.run, args.out, min_reward=args.min_reward)
            print(report)
            return 0
        if args.command == "view":
            from polar_fast.report.view import serve_view

            uvloop.run(serve_view(args.run, host=args.host, port=args.port, key=args.key))
            return 0
        cfg = load_config(args.config, args.overrides)
        from polar_fast.rollouts.harnesses import run_harness

        run_harness(cfg.harness)  # a bad harness definition: one line, before anything starts
        if args.command == "tasks":
            return _validate_tasks(cfg, args)
        if args.command == "serve":
            return _serve(cfg, args.host, args.port, rollouts=args.rollouts)
        if args.command == "eval":
            return _eval(cfg, args)
        if args.command == "check":
            from polar_fast.preflight import run_check

            return run_check(cfg, nproc_per_node=args.nproc_per_node, out=sys.stdout)
        if args.command == "export-model":
            from polar_fast.learner.checkpoint import export_hf

            print(f"model: {export_hf(args.checkpoint, cfg.model.path, args.out)}")
            return 0
        if args.command == "sft":
            from polar_fast.grpo import Learner
            from polar_fast.learner.sft import run_sft

            report = run_sft(cfg, args.data, Learner.from_config, out_dir=args.out or Path(cfg.run.output_dir) / "sft",
                             epochs=args.epochs, lr=args.lr,
                             emit=lambda kind, data: print(data["message"], file=sys.stderr, flush=True))
            print(f"sft: {report.rows} rows, {report.trained_tokens} trained tokens, {report.steps} steps in "
                  f"{report.duration_s:.0f} s; nll {report.nll_before:.4f} -> {report.nll_after:.4f}; "
                  f"model: {report.model_dir}")
            return 0
        return _train(cfg, resume=args.resume, quiet=args.quiet)
    except PolarError as e:
        print(f"polar_fast: {e}", file=sys.stderr)
        return 2


def _train(cfg: Config, *, resume: bool, quiet: bool) -> int:
    from polar_fast.learner import distributed

    rank = distributed.init(cfg)  # under torchrun; 0 otherwise
    try:
        if rank > 0:  # the learner only, driven by rank 0
            from polar_fast.grpo import Learner

            distributed.follow(cfg, Learner.from_config)
            return 0
        from polar_fast.report.progress import Progress
        from polar_fast.train import train

        with Progress(steps=cfg.run.steps, enabled=not quiet) as progress:
            summary = uvloop.run(train(cfg, resume=resume, on_event=progress.event))
        progress.print_summary(summary)
        return 0
    finally:
        distributed.shutdown()


def _eval(cfg: Config, args: argparse.Namespace) -> int:
    from polar_fast.evaluate import EvalError, format_report, run_eval, write_report

    try:
        ks = [int(k) for k in args.k.split(",")] if args.k else list(cfg.eval.k)
    except ValueError:
        raise EvalError(f"--k takes comma-separated integers, got {args.k!r}") from None
    harnesses = [h for h in args.harness.split(",") if h] or list(cfg.eval.harnesses)

    def info(kind: str, data: dict) -> None:
        if kind == "info":
            print(data["message"], file=sys.stderr, flush=True)

    report = uvloop.run(run_eval(
        cfg, harnesses=harnesses, samples=args.samples or cfg.eval.samples, ks=ks, split=args.split,
        limit=cfg.eval.limit if args.limit is None else args.limit, checkpoint=args.checkpoint, emit=info,
        guided=args.guided))
    out = write_report(report, args.out or Path(cfg.run.output_dir) / "eval" / f"{report.split}.json")
    print(format_report(report))
    print(f"report: {out}")
    return 0


def _serve(cfg: Config, host: str | None, port: int | None, *, rollouts: bool) -> int:
    if rollouts:
        from polar_fast.serve import serve_rollouts

        uvloop.run(serve_rollouts(cfg, host=host, port=port))
        return 0
    from polar_fast.serve import serve_forever

    uvloop.run(serve_forever(cfg, host=host, port=port))
    return 0


def _validate_tasks(cfg: Config, args: argparse.Namespace) -> int:
    """Exit 0 when every task holds, 1 when some do not (the report names them)."""
    import msgspec

    from polar_fast.rollouts.validate import HOLDS, format_report, run_validation

    checks = uvloop.run(run_validation(cfg, args.source, split=args.split or cfg.tasks.split, limit=args.limit,
                                       workers=args.workers, on_check=lambda c: print(
                                           f"{c.verdict:7} {c.instance_id}", flush=True)))
    print(format_report(checks))
    if args.json is not None:
        args.json.write_bytes(msgspec.json.encode(checks))
    return 0 if all(c.verdict == HOLDS for c in checks) else 1


def _check_harness(cfg: Config, target: str, json_out: Path | None) -> int:
    """Exit 0 when no line of `harnesses check` fails, 1 when one does."""
    import msgspec

    from polar_fast.preflight.harness_check import check_harness, format_report

    report = uvloop.run(check_harness(cfg, target))
    print(format_report(report))
    if json_out is not None:
        json_out.write_bytes(msgspec.json.encode(report))
    return 0 if report.ok else 1


def _install_harnesses(parser: argparse.ArgumentParser, names: list[str], *, every: bool,
                       bundle_root: Path | None) -> int:
    """Build (or find cached) harness bundles; a no-op for those already cached."""
    from polar_fast.rollouts.harnesses import HARNESSES, BundleError, default_bundle_root, get_harness

    if not every and not names:
        parser.error("harnesses install: name harnesses to install, or --all")
    try:
        harnesses = list(HARNESSES.values()) if every else [_named(n) for n in names]
    except ValueError as e:
        parser.error(str(e))
    root = bundle_root or default_bundle_root()
    for harness in harnesses:
        try:
            path = harness.install(root)
        except BundleError as e:  # a PolarError: main prints it and exits 2
            raise BundleError(f"install {harness.name}: {e}") from None
        print(f"{harness.name} {path}", flush=True)
    return 0



def _named(target: str):
    """A built-in harness by name, or the one a definition file declares."""
    from polar_fast.config import HarnessConfig
    from polar_fast.rollouts.harnesses import run_harness, select

    return run_harness(select(HarnessConfig(), target))
