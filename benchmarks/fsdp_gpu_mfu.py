"""One GPU: step time, peak memory and MFU of timm ViT-B/L with and without FSDP2 (bf16 autocast).

Standalone (torch + timm only) so it runs on a lent GPU machine whose checkout lacks the
trainer's mesh engine; MFU = vitpod.analysis.layout.step_flops / step time / the GPU's bf16 peak,
computed afterwards (benchmarks/results/fsdp_gpu_mfu.json).
"""

import json
import os
import time

import timm
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29511")
dist.init_process_group("nccl", rank=0, world_size=1)
torch.cuda.set_device(0)


def run(name, fsdp, b, n=20):
    torch.manual_seed(0)
    m = timm.create_model(name, num_classes=1000).cuda()
    if fsdp:
        for blk in m.blocks:
            fully_shard(blk)
        fully_shard(m)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=True)
    x = torch.randn(b, 3, 224, 224, device="cuda")
    y = torch.randint(0, 1000, (b,), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    ts = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    s = sorted(ts[5:])[len(ts[5:]) // 2]
    r = dict(
        model=name,
        fsdp=fsdp,
        batch=b,
        step_s=s,
        img_s=b / s,
        peak_gib=torch.cuda.max_memory_allocated() / 2**30,
        loss=loss.item(),
    )
    print(json.dumps(r), flush=True)
    del m, opt
    torch.cuda.empty_cache()
    return r


R = [
    run(n, f, b)
    for n, b in (("vit_base_patch16_224", 128), ("vit_large_patch16_224", 64))
    for f in (False, True)
]
print(torch.cuda.get_device_name(0), torch.__version__)
out = os.environ.get("OUT", ".")
os.makedirs(out, exist_ok=True)
json.dump(R, open(out + "/gpu.json", "w"), indent=1)
dist.destroy_process_group()
