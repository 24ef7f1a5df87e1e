"""Ring all-reduce, parameter-server hook and DDP's built-in reducer give bit-identical training."""

import os

import pytest
import torch
import torch.multiprocessing as mp

from tests.helpers import free_port

STEPS = 4
PRELOAD = [
    "vitpod.trainer.engines.ddp_engine", "vitpod.trainer.model.models",
    "vitpod.trainer.model.optim", "vitpod.trainer.speed.precision", "vitpod.trainer.dist",
]  # fmt: skip


def _worker(rank: int, world: int, port: int, servers: int, out: dict) -> None:
    torch.set_num_threads(1)
    from vitpod.trainer import dist as tdist

    tdist.init(tdist.DistEnv(rank, rank, world, "127.0.0.1", port, "torchrun"))
    for exchange in ("builtin", "ring", "ps"):
        _train(rank, world, exchange, servers, out)
    tdist.teardown()


def _train(rank: int, world: int, exchange: str, servers: int, out: dict) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from vitpod.trainer.engines.ddp_engine import DDPEngine
    from vitpod.trainer.model.models import create_model
    from vitpod.trainer.model.optim import create_optimizer
    from vitpod.trainer.speed.precision import make_precision

    device = torch.device("cpu")
    torch.manual_seed(0)
    model = create_model("volo_tiny", 32, 10, 0.0)
    optimizer, _ = create_optimizer(model, "adamw", 1e-2, 0.05, device)
    precision = make_precision(device, False, False, "bf16", False)
    if exchange == "builtin":
        ddp = DDP(model, find_unused_parameters=True)  # the engine's fixed bucket layout
    else:
        engine = DDPEngine(model, optimizer, precision, exchange, servers, 1, None)
    gen = torch.Generator().manual_seed(100 + rank)  # every rank sees different data
    for _ in range(STEPS):
        images = torch.randn(4, 3, 32, 32, generator=gen)
        targets = torch.randint(0, 10, (4,), generator=gen)
        if exchange == "builtin":
            torch.nn.functional.cross_entropy(ddp(images), targets).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        else:
            engine.backward(torch.nn.functional.cross_entropy(engine.forward(images), targets))
            engine.step()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    if rank == 0:
        out[exchange] = flat.clone()
    out[f"{exchange}-comm-{rank}"] = 0.0 if exchange == "builtin" else engine.comm_seconds()


@pytest.mark.parametrize("world,servers", [(2, 1), (3, 2)])
def test_ring_ps_and_builtin_are_bit_identical(world: int, servers: int) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    with mp.Manager() as manager:
        out = manager.dict()
        # One forkserver that imports the trainer's modules once forks every rank: spawned
        # ranks imported torch and timm each (5 x 5 CPU-s for the two cases).
        mp.set_forkserver_preload(PRELOAD)
        mp.start_processes(_worker, args=(world, free_port(), servers, out), nprocs=world,
                           join=True, start_method="forkserver")  # fmt: skip
        results = dict(out)
    assert torch.equal(results["ring"], results["builtin"])
    assert torch.equal(results["ps"], results["builtin"])
    # The hooks really ran (their clocks moved), and training changed the weights.
    assert all(results[f"ps-comm-{r}"] > 0 for r in range(world))
    torch.manual_seed(0)
    from vitpod.trainer.model.models import create_model

    initial = torch.cat([p.flatten() for p in create_model("volo_tiny", 32, 10, 0.0).parameters()])
    assert not torch.equal(initial, results["ring"])
