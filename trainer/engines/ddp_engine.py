"""DDP with a ring all-reduce or parameter-server comm hook, timed per step."""

import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from vitpod.trainer.engines.engine import NotPipelined, token_label_forward
from vitpod.trainer.model.optim import match_state_layout
from vitpod.trainer.speed.precision import Precision

log = logging.getLogger(__name__)


@dataclass
class CommState:
    """Per-step communication clock shared with the DDP comm hooks (callbacks run off-thread)."""

    world_size: int
    servers: tuple[int, ...] = ()
    group: Any = None  # the parameter server's own process group (None: the default one)
    seconds: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, start: float) -> None:
        with self.lock:
            self.seconds += time.perf_counter() - start

    def pop(self) -> float:
        with self.lock:
            value, self.seconds = self.seconds, 0.0
        return value


def _scale_like_builtin(bucket: dist.GradBucket, world_size: int) -> torch.Tensor:
    # DDP's built-in reducer multiplies each gradient by 1/world_size (a wrapped double scalar)
    # while copying it into the bucket, then sums; doing the same keeps results bit-identical.
    return bucket.buffer().mul_(1.0 / world_size)


def ring_hook(state: CommState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The built-in all-reduce arithmetic, timed."""
    start = time.perf_counter()
    buffer = _scale_like_builtin(bucket, state.world_size)
    fut = cast(dist.Work, dist.all_reduce(buffer, async_op=True)).get_future()

    def done(f: torch.futures.Future) -> torch.Tensor:
        state.record(start)
        return f.value()[0]

    return fut.then(done)


def ps_hook(state: CommState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Parameter server: reduce the bucket to its server rank, which broadcasts the sum back."""
    start = time.perf_counter()
    buffer = _scale_like_builtin(bucket, state.world_size)
    server = state.servers[bucket.index() % len(state.servers)]
    fut = cast(
        dist.Work, dist.reduce(buffer, dst=server, group=state.group, async_op=True)
    ).get_future()

    def broadcast(_: torch.futures.Future) -> torch.Tensor:
        dist.broadcast(buffer, src=server, group=state.group)
        state.record(start)
        return buffer

    return fut.then(broadcast)


def server_ranks(world_size: int, servers: int) -> tuple[int, ...]:
    """S server ranks spread evenly over the ranks (so over nodes, not all on the first one)."""
    return tuple(i * world_size // servers for i in range(servers))


class TrainForward(nn.Module):
    """Routes training passes through the token-labeling forward, inside DDP's reducer."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.inner = model

    def forward(self, images: torch.Tensor) -> Any:
        return token_label_forward(self.inner, images) if self.training else self.inner(images)


class DDPEngine(NotPipelined):
    """DDP with a ring or parameter-server comm hook; AMP scaling, clipping, accumulation."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, precision: Precision,
                 exchange: str, ps_servers: int, accum_steps: int, clip_grad: float | None,
                 token_label: bool = False, clip_mode: str = "norm") -> None:  # fmt: skip
        world = dist.get_world_size()
        self.name = exchange
        self.model = model
        self.optimizer = optimizer
        self.precision = precision
        self.accum_steps = accum_steps
        self.clip_grad, self.clip_mode = clip_grad, clip_mode
        device_ids = [precision.device.index] if precision.device.type == "cuda" else None
        wrapped = TrainForward(model) if token_label else model
        # Exact resume needs one bucket layout for the whole run. DDP reduces a process's first
        # iteration in one bucket of parameters in reverse order, then rebuilds its buckets in
        # the order gradients became ready ("Reducer buckets have been rebuilt"): a resumed
        # process would reduce its first step in the other layout. With 3+ ranks an element's
        # place in the buffer sets the order in which the ring all-reduce adds the ranks'
        # values, so the rounding (and every later parameter) would differ from an
        # uninterrupted run. find_unused_parameters=True keeps DDP's initial size-capped
        # layout for good (the reducer never rebuilds with it), at the cost of one autograd
        # graph traversal per iteration (PyTorch DDP notes, "Internal Design").
        self.ddp = DDP(wrapped, device_ids=device_ids, find_unused_parameters=True)
        self.comm = CommState(world, server_ranks(world, ps_servers) if exchange == "ps" else ())
        if exchange == "ps":
            # The broadcast runs in the reduce's completion callback, on a communication thread,
            # while find_unused_parameters makes the reducer all-reduce its used-parameter map
            # on the default group from the backward thread: on one group the two would be
            # issued in different orders on different ranks and hang. A group of its own keeps
            # each stream of collectives in one order.
            self.comm.group = dist.new_group(backend=dist.get_backend())
        self.ddp.register_comm_hook(self.comm, ps_hook if exchange == "ps" else ring_hook)

    def micro_step(self, last: bool) -> contextlib.AbstractContextManager:
        """Gradients are exchanged only on the last micro-batch of an accumulation."""
        return contextlib.nullcontext() if last else self.ddp.no_sync()

    def forward(self, images: torch.Tensor) -> Any:
        return self.ddp(images)

    def backward(self, loss: torch.Tensor) -> None:
        loss = loss / self.accum_steps
        scaler = self.precision.scaler
        (scaler.scale(loss) if scaler else loss).backward()

    def step(self) -> None:
        scaler = self.precision.scaler
        if self.clip_grad:
            if scaler:
                scaler.unscale_(self.optimizer)
            from timm.utils import dispatch_clip_grad  # timm's --clip-mode: norm, value, agc

            dispatch_clip_grad(self.model.parameters(), self.clip_grad, mode=self.clip_mode)
        if scaler:
            scaler.step(self.optimizer)
            scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def comm_seconds(self) -> float:
        return self.comm.pop()

    counts_eval = True  # every rank evaluates its own shard of the validation set

    def eval_forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images)

    def wait_sharded(self) -> None:
        pass

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def save_sharded(self, directory: Path) -> None:
        del directory  # DDP state is replicated: rank 0's file holds it

    def load_sharded(self, directory: Path) -> None:
        del directory

    def state_dict(self) -> dict[str, Any]:
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        if self.precision.scaler:
            state["scaler"] = self.precision.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        match_state_layout(self.optimizer)
        if self.precision.scaler and "scaler" in state:
            self.precision.scaler.load_state_dict(state["scaler"])
