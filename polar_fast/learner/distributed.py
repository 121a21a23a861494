"""The training run under torchrun: rank 0 runs the run, ranks > 0 follow its learner.

    CUDA_VISIBLE_DEVICES=4,5,6,7 torchrun --nproc_per_node 4 -m polar_fast --config run.toml

Rank 0 runs everything `app.train` does (tasks, pools, proxy, engine, metrics, checkpoints) plus
learner rank 0. Ranks > 0 only build the same Learner (FSDP2-sharded, grpo.py; the CLI passes
its builder to `follow`) and follow.
Every learner call that is collective under FSDP2 is announced by rank 0 with one message on a
CPU (gloo) control group, then every rank makes the same call with the same data:

    step    groups, gate       every rank: learner.step(groups, gate=gate) (the first step's mismatch gate)
    sync                       every rank reads learner.weight_stream(); rank 0 pushes it
    save    directory          every rank: learner.save(directory) (rank 0 writes the file)
    resume  directory          every rank: learner.resume(directory)
    stop                       followers return (rank 0 sends it after the final checkpoint)

Rank 0's learner is wrapped in a `Leader` with the Learner's interface, so train.py calls it as
before. Choices:
- Messages are msgspec msgpack (GroupRecord Structs, rollouts/groups.py), sent as one bytes object
  with `broadcast_object_list`: compact, and no pickle of thousands of small objects.
- Waiting happens only on the control group, whose timeout is CONTROL_TIMEOUT: followers wait
  there while rollouts run, which can take hours, whereas the default (NCCL) group times out in
  minutes. A message is sent just before rank 0 enters the matching collectives, so nobody waits
  inside NCCL. If rank 0 dies, torchrun stops the followers (its default on a worker failure).
- Followers ignore SIGINT/SIGTERM: a Ctrl-C reaches every rank, and rank 0's graceful stop
  (checkpoint, then `stop`) still needs them. torchrun SIGKILLs them if they outlive it.
- Devices: `learner.device = "cuda"` means cuda:LOCAL_RANK (set before the model is built) and
  the default group uses NCCL; "cpu" uses gloo (tests). Which physical GPUs the ranks get is
  the `CUDA_VISIBLE_DEVICES` of the torchrun command; a vLLM started by rank 0 gets
  `engine.launch_gpus` as absolute ids instead (engines/vllm_launch.py).
"""

from __future__ import annotations

import asyncio
import os
import signal
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Literal, Protocol, Sequence

import msgspec

from polar_fast.errors import ConfigError
from polar_fast.learner.mismatch import Gate
from polar_fast.rollouts.groups import GroupRecord

if TYPE_CHECKING:
    from polar_fast.config import Config

CONTROL_TIMEOUT = timedelta(days=7)  # a follower's longest wait for rank 0's next message


class Message(msgspec.Struct, frozen=True, kw_only=True):
    kind: Literal["step", "sync", "save", "resume", "stop"]
    directory: str = ""
    groups: list[GroupRecord] = []
    gate: Gate | None = None


class Learner(Protocol):
    """The learner calls the ranks make together (grpo.Learner)."""

    world: int
    version: int

    def step(self, groups: Sequence[GroupRecord], *, gate: Gate | None = None, control: Any = None) -> Any: ...

    def weight_stream(self) -> Any: ...

    def save(self, directory: str) -> str: ...

    def resume(self, directory: str) -> bool: ...


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init(cfg: Config) -> int:
    """Join torchrun's process group (when WORLD_SIZE > 1) and pin this rank's GPU; returns the
    rank, 0 without torchrun."""
    if world_size() <= 1:
        return 0
    import torch
    import torch.distributed as dist

    device = cfg.learner.device
    if device.startswith("cuda"):
        if device != "cuda":
            raise ConfigError(f"learner.device = {device!r}: under torchrun use 'cuda' (each rank takes "
                              "cuda:LOCAL_RANK of the CUDA_VISIBLE_DEVICES torchrun was given)")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return dist.get_rank()


def shutdown() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        # every rank done with its collectives before any tears down its gloo threads: a rank
        # that exits while a peer still talks to it can abort ("terminate called without an
        # active exception")
        dist.barrier()
        dist.destroy_process_group()


def _control_group() -> Any:
    """The gloo group for messages. Collective: rank 0 (in `lead`) and the followers (in
    `follow`) create it at the same point, right after building the Learner."""
    import torch.distributed as dist

    return dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)


def _broadcast(message: Message | None, group: Any) -> Message:
    import torch.distributed as dist

    box = [_encoder.encode(message) if message is not None else None]
    dist.broadcast_object_list(box, src=0, group=group)
    return message if message is not None else _decoder.decode(box[0])


class Leader:
    """Rank 0's learner: announces each collective call to the followers, then makes it.
    Other attributes (step_count, version, cfg, ...) are the wrapped Learner's."""

    def __init__(self, learner: Learner) -> None:
        self.learner = learner
        self._group = _control_group()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.learner, name)

    def _send(self, message: Message) -> None:
        _broadcast(message, self._group)

    def step(self, groups: Sequence[GroupRecord], *, gate: Gate | None = None, control: Any = None):
        """`control` shows rank 0's progress; a multi-rank step is not interruptible (step_control.py)."""
        self._send(Message(kind="step", groups=list(groups), gate=gate))
        return self.learner.step(groups, gate=gate, control=control)

    async def sync_weights(self, sync: Any) -> None:
        """As Learner.sync_weights, with the gathering off the event loop."""
        await asyncio.to_thread(self._send, Message(kind="sync"))
        # gathered one tensor at a time as the sync reads them (DiskSync: in its writer thread)
        await sync.push(self.learner.weight_stream(), version=self.learner.version)

    def save(self, directory: str) -> str:
        self._send(Message(kind="save", directory=directory))
        return self.learner.save(directory)

    def resume(self, directory: str) -> bool:
        self._send(Message(kind="resume", directory=directory))
        return self.learner.resume(directory)

    def stop_followers(self) -> None:
        self._send(Message(kind="stop"))


def lead(learner: Learner) -> Learner | Leader:
    """Rank 0: the learner as train.py should call it (a Leader under torchrun)."""
    return Leader(learner) if learner.world > 1 else learner


def stop_followers(learner: Learner | Leader) -> None:
    """Rank 0, at the end of a run that went well: let the followers return."""
    if isinstance(learner, Leader):
        learner.stop_followers()


def follow(cfg: Config, build_learner: Callable[[Config], Learner]) -> int:
    """Ranks > 0: build the learner as rank 0 does (`build_learner(cfg)`: grpo.Learner.from_config),
    then make each announced call until `stop`. Returns the number of steps taken."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    learner = build_learner(cfg)
    group = _control_group()
    steps = 0
    while True:
        message = _broadcast(None, group)
        match message.kind:
            case "step":  # a failed gate raises here as on rank 0: torchrun stops the ranks
                learner.step(message.groups, gate=message.gate)
                steps += 1
            case "sync":
                for _ in learner.weight_stream():  # the gathers are the collective part, in rank 0's order
                    pass
            case "save":
                learner.save(message.directory)
            case "resume":
                learner.resume(message.directory)
            case "stop":
                return steps
