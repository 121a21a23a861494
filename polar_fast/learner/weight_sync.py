"""Pushing the learner's weights to the inference engine, behind one `push()`.

- `EngineSync`: hands (name, tensor) pairs to `engine.update_weights(...)` in process (the
  embedded engine copies them into its model; generation in flight finishes on old weights).
- `DiskSync`: writes a HF safetensors checkpoint (the serving dtype, tied weights once) into the
  directory the engine serves from, then `engine.update_weights(None, version=...)` makes it
  reload from disk (vLLM: engines/vllm.py, which pauses with mode=keep; embedded: reload its
  path). The fallback that works with any vLLM build.
- `VllmTransferSync`: vLLM's dev-mode weight transfer (VLLM_SERVER_DEV_MODE=1,
  --weight-transfer-config): POST /init_weight_transfer_engine once, then per sync
  /pause?mode=keep (calls in flight are frozen, not aborted), /start_weight_update,
  /update_weights with the metadata (names, dtype_names, shapes) while the tensors travel out of
  band (NCCL broadcast by a `sender`), /finish_weight_update with the version label,
  /reset_prefix_cache, /resume.
  The data plane is a pluggable `Sender` so the HTTP part is tested here against a local fake
  and the NCCL part (needs vLLM and a GPU) is imported only when used.
  No caller yet (the run uses DiskSync), and `NcclSender` calls the trainer API of vLLM before
  0.32 (`NCCLWeightTransferEngine.trainer_init` / `trainer_send_weights`): 0.32, the version
  tested, moved it to `NCCLTrainerWeightTransferEngine.trainer_init(info, client=, source=)`,
  which drives the HTTP calls itself. Not ported, since no backend runs on a CPU (nccl,
  sparse_nccl and nccl_m2n open a PyNccl communicator, ipc shares CUDA IPC handles).

Every sync ends with the engine's `policy_version` set to the new version, which the proxy
stamps on every call record it captures afterwards.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Protocol

import aiohttp

from polar_fast.errors import WeightSyncError

if TYPE_CHECKING:
    import torch

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
    if isinstance(named_tensors, WeightStream):  # gathered as written, never all at once
        specs, stream = named_tensors.specs, named_tensors
    else:
        kept, seen = [], set()
        for name, t in named_tensors:
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
            if key not in seen:
                seen.add(key)
                kept.append((name, t))
        specs, stream = [(name, tuple(t.shape)) for name, t in kept], kept
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

    def init_info(self) -> dict[str, Any]: ...  # JSON sent as init_info
    async def connect(self) -> None: ...  # runs concurrently with POST /init_weight_transfer_engine
    async def send(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None: ...  # with POST /update_weights


class VllmTransferSync:
    """vLLM dev-mode weight-transfer API; see the module docstring for the call sequence."""

    def __init__(
        self,
        base_url: str,
        sender: Sender,
        *,
        engine: Any = None,
        timeout_s: float = 600.0,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.sender = sender
        self.engine = engine  # its policy_version is set after each sync (the proxy reads it)
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session = session
        self._connected = False

    async def push(self, named_tensors: NamedTensors, *, version: int) -> None:
        pairs = list(named_tensors)
        if not self._connected:
            await asyncio.gather(
                self._post("/init_weight_transfer_engine", {"init_info": self.sender.init_info()}),
                self.sender.connect(),
            )
            self._connected = True
        update_info = {
            "names": [n for n, _ in pairs],
            "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in pairs],
            "shapes": [list(t.shape) for _, t in pairs],
            "packed": False,
        }
        await self._post("/pause?mode=keep&clear_cache=false", None)  # see engines/vllm.py
        try:
            await self._post("/start_weight_update", {"is_checkpoint_format": True})
            await asyncio.gather(self._post("/update_weights", {"update_info": update_info}),
                                 self.sender.send(pairs))
            # the label vLLM stamps on every token sampled from now on (its weight_versions spans)
            await self._post("/finish_weight_update", {"weight_version": str(version)})
            await self._post("/reset_prefix_cache?reset_running_requests=true", None)
        finally:
            await self._post("/resume", None)
        if self.engine is not None:
            self.engine.policy_version = version

    async def _post(self, path: str, body: dict[str, Any] | None) -> None:
        session = self._session
        if session is None:
            session = self._session = aiohttp.ClientSession(timeout=self._timeout)
        try:
            async with session.post(self.base_url + path, json=body) as resp:
                if resp.status >= 400:
                    text = (await resp.text())[:500]
                    raise WeightSyncError(f"vLLM {path} answered {resp.status}: {text}")
        except aiohttp.ClientError as e:
            raise WeightSyncError(f"vLLM {path} failed: {e}") from e

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class NcclSender:
    """NCCL broadcast through vLLM's own NCCLWeightTransferEngine (GPU only; imports vLLM lazily).

    The trainer is rank 0 of a group with the vLLM workers (ranks 1..world_size-1)."""

    def __init__(self, *, master_address: str, master_port: int, world_size: int) -> None:
        self._info = {"master_address": master_address, "master_port": master_port,
                      "rank_offset": 1, "world_size": world_size}
        self._group: Any = None

    def init_info(self) -> dict[str, Any]:
        return dict(self._info)

    async def connect(self) -> None:
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

        self._group = await asyncio.to_thread(NCCLWeightTransferEngine.trainer_init, self._info)

    async def send(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

        args = {"group": self._group, "src": 0, "packed": False}
        await asyncio.to_thread(NCCLWeightTransferEngine.trainer_send_weights, iter(named_tensors), args)
