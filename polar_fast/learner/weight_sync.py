"""Pushing the learner's weights to the inference engine, behind one `push()`.

- `EngineSync`: hands (name, tensor) pairs to `engine.update_weights(...)` in process (the
  embedded engine copies them into its model; generation in flight finishes on old weights).
- `DiskSync`: writes a HF safetensors checkpoint (the serving dtype, tied weights once) into the
  directory the engine serves from, then `engine.update_weights(None, version=...)` makes it
  reload from disk (vLLM: engines/vllm.py, which pauses with mode=keep; embedded: reload its
  path). The fallback that works with any vLLM build.
- `VllmTransferSync`: vLLM's dev-mode weight transfer (`engine.weight_sync = "transfer"`;
  VLLM_SERVER_DEV_MODE=1, --weight-transfer-config, both set by engines/vllm_launch.py). Once:
  GET /get_world_size, then POST /init_weight_transfer_engine concurrently with the sender's
  rendezvous. Per sync: /pause?mode=keep (calls in flight are frozen, not aborted),
  /start_weight_update, /update_weights with the metadata (names, dtype_names, shapes; the
  serving dtype) while the tensors travel out of band, /finish_weight_update,
  /reset_prefix_cache, /update_weight_version (the label), /resume: the engine's own pause
  block, the one the disk reload uses. Each tensor is converted to the serving dtype as it is
  sent, so no second copy of the model exists.
  The data plane is a pluggable `Sender`: the HTTP part is tested against a local fake, its
  bodies against vLLM 0.32's own init and update dataclasses, and `NcclSender` (vLLM 0.32's
  `nccl_common.trainer_init` communicator, a broadcast per tensor) needs a GPU: no transfer
  backend of vLLM runs on a CPU (nccl, sparse_nccl and nccl_m2n open a PyNccl communicator,
  ipc shares CUDA IPC handles). vLLM's own trainer engine
  (`NCCLTrainerWeightTransferEngine`) is not used because it drives the HTTP calls itself,
  with a blocking client, no pause mode and no version label.

Every sync ends with the engine's `policy_version` set to the new version, which the proxy
stamps on every call record it captures afterwards.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Protocol

from polar_fast.errors import WeightSyncError

if TYPE_CHECKING:
    import torch

    from polar_fast.config import Config

NamedTensors = Iterable[tuple[str, "torch.Tensor"]]


class WeightStream:
    """Named weights whose names and shapes are known before their data. Under FSDP2 a full
    tensor is gathered only when the stream reaches it (a collective every rank makes, in this
    order), so no rank holds the whole unsharded model at once: an 8B model's 32 GB of fp32 on
    GPU 0, beside its shard. DiskSync writes the file's header from `specs`, then one gathered
    tensor at a time. Tied weights are already left out (Learner.weight_stream)."""

    def __init__(self, specs: list[tuple[str, tuple[int, ...]]], tensors: Iterator[torch.Tensor]) -> None:
        self.specs = specs
        self._tensors = tensors

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for (name, shape), t in zip(self.specs, self._tensors, strict=True):
            if tuple(t.shape) != shape:
                raise WeightSyncError(f"weight stream: {name} came as {tuple(t.shape)}, announced {shape}")
            yield name, t


class WeightSync(Protocol):
    async def push(self, named_tensors: NamedTensors, *, version: int) -> None: ...


def weight_sync_for(cfg: Config, engine: Any, run_dir: Path) -> WeightSync:
    """How the run's weights reach `engine`: vLLM by NCCL transfer or by reloading
    `<run_dir>/weights` (the directory the launcher serves), an in-process engine directly. A
    training run and a Ray run's driver (for servers the user started) both choose here."""
    e = cfg.engine
    if e.kind == "vllm" and e.weight_sync == "transfer":
        return VllmTransferSync(engine, NcclSender(master_port=e.transfer_port), dtype=e.dtype)
    if e.kind == "vllm":
        return DiskSync(engine, run_dir / "weights", dtype=e.dtype)
    return EngineSync(engine)


class EngineSync:
    """In-process: the engine's own update_weights (embedded engine)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    async def push(self, named_tensors: NamedTensors, *, version: int) -> None:
        await self.engine.update_weights(list(named_tensors), version=version)


class DiskSync:
    """Reload from disk: save safetensors into `directory` in the engine's serving `dtype`, then
    ask the engine to reload."""

    def __init__(self, engine: Any, directory: str | Path, *, dtype: str = "float32") -> None:
        self.engine = engine
        self.directory = Path(directory)
        self.dtype = dtype

    async def push(self, named_tensors: NamedTensors, *, version: int) -> None:
        await asyncio.to_thread(save_safetensors, named_tensors, self.directory / "model.safetensors", dtype=self.dtype)
        await self.engine.update_weights(None, version=version)


def _specs_and_stream(named_tensors: NamedTensors) -> tuple[list[tuple[str, tuple[int, ...]]], NamedTensors]:
    """Names and shapes before any data: a WeightStream announces them (gathered as consumed);
    plain pairs are read once, a tensor sharing storage with an earlier one (tied embeddings)
    left out, as the model's own checkpoint has it."""
    if isinstance(named_tensors, WeightStream):
        return named_tensors.specs, named_tensors
    kept, seen = [], set()
    for name, t in named_tensors:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key not in seen:
            seen.add(key)
            kept.append((name, t))
    return [(name, tuple(t.shape)) for name, t in kept], kept


_SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def save_safetensors(named_tensors: NamedTensors, path: Path, *, dtype: str = "float32") -> None:
    """The weights as one safetensors file in `dtype`, written a tensor at a time: the header
    first (names, shapes, offsets), then each tensor converted and written on its own, so the
    serving-dtype copy never exists whole beside the learner's weights (an 8B model: 16 GB of
    bf16 it would otherwise hold at once). Atomic (tmp + rename): a reader never sees half a
    checkpoint. A tensor sharing storage with an earlier one (tied embeddings: lm_head.weight is
    embed_tokens.weight) is written once, as the model's own checkpoint has it; the engine ties
    it again on load."""
    import json

    import torch

    target = getattr(torch, dtype)
    specs, stream = _specs_and_stream(named_tensors)  # a WeightStream is gathered as written
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset, width = 0, target.itemsize
    for name, shape in specs:
        n_bytes = math.prod(shape) * width
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n_bytes]}
        offset += n_bytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(len(head).to_bytes(8, "little") + head)
        for _, t in stream:  # one converted tensor alive at a time
            f.write(t.detach().to("cpu", dtype=target).contiguous().reshape(-1).view(torch.uint8).numpy().data)
    tmp.replace(path)


class Sender(Protocol):
    """The out-of-band data plane of a vLLM weight transfer."""

    def init_info(self, engine_world_size: int) -> dict[str, Any]: ...  # the workers' init_info
    async def connect(self) -> None: ...  # runs concurrently with POST /init_weight_transfer_engine
    async def send(self, named_tensors: NamedTensors) -> None: ...  # concurrently with POST /update_weights


class VllmTransferSync:
    """vLLM dev-mode weight-transfer API; see the module docstring for the call sequence. Every
    call goes through the engine's own `control` (engine.sync_timeout_s, the failed step named)
    inside its `paused` block (pause mode, prefix-cache reset, version label, resume on any
    failure), as the disk reload does (engines/vllm.py)."""

    def __init__(self, engine: Any, sender: Sender, *, dtype: str = "float32") -> None:
        self.engine = engine  # a VllmEngine; its policy_version is set after each sync (the proxy reads it)
        self.sender = sender
        self.dtype = dtype  # the engine's serving dtype: what the workers allocate and receive
        self._connected = False

    async def push(self, named_tensors: NamedTensors, *, version: int) -> None:
        import json

        import torch

        control = self.engine.control
        if not self._connected:
            world = json.loads(await control("read the engine's world size", "/get_world_size", method="GET"))
            init_info = self.sender.init_info(int(world["world_size"]))
            await asyncio.gather(control("open the transfer group", "/init_weight_transfer_engine",
                                         {"init_info": init_info}),
                                 self.sender.connect())
            self._connected = True
        specs, stream = _specs_and_stream(named_tensors)
        target = getattr(torch, self.dtype)
        update_info = {"names": [n for n, _ in specs], "dtype_names": [self.dtype] * len(specs),
                       "shapes": [list(shape) for _, shape in specs]}
        async with self.engine.paused(version):
            await control("start the weight update", "/start_weight_update")
            await asyncio.gather(control("receive the weights", "/update_weights", {"update_info": update_info}),
                                 self.sender.send((n, t.detach().to(dtype=target)) for n, t in stream))
            await control("finish the weight update", "/finish_weight_update")


class NcclSender:
    """NCCL broadcast from the learner (rank 0) to the vLLM workers (ranks 1..world), through
    the communicator vLLM 0.32's `nccl_common.trainer_init` opens (GPU only; imports vLLM
    lazily). Unpacked: one broadcast per tensor, in the order of the update metadata."""

    def __init__(self, *, master_address: str = "127.0.0.1", master_port: int = 0) -> None:
        self.master_address = master_address
        self.master_port = master_port  # 0: a free port, chosen at init
        self._world_size = 0
        self._group: Any = None

    def init_info(self, engine_world_size: int) -> dict[str, Any]:
        if not self.master_port:
            import socket

            with socket.socket() as s:
                s.bind((self.master_address, 0))
                self.master_port = s.getsockname()[1]
        self._world_size = 1 + engine_world_size
        return {"master_address": self.master_address, "master_port": self.master_port,
                "rank_offset": 1, "world_size": self._world_size, "packed": False}

    async def connect(self) -> None:
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        rendezvous = {"master_address": self.master_address, "master_port": self.master_port,
                      "world_size": self._world_size}
        self._group = await asyncio.to_thread(trainer_init, rendezvous)

    async def send(self, named_tensors: NamedTensors) -> None:
        await asyncio.to_thread(self._broadcast, named_tensors)

    def _broadcast(self, named_tensors: NamedTensors) -> None:
        import torch

        stream = torch.cuda.current_stream()
        for _, t in named_tensors:  # NCCL reads numel elements from data_ptr: contiguous, on the GPU
            self._group.broadcast(t.to("cuda").contiguous(), src=0, stream=stream)
        stream.synchronize()
