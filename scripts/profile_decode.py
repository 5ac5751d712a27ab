"""Where a decode step's time goes: torch.profiler over N decode steps of one request.
(FT_CUDA_GRAPHS=1 profiles the graphed step: kernels inside graphs still show.)"""

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from ft.engine.config import EngineConfig
from ft.engine.runner import LLMEngine, SamplingParams

model, strategy = sys.argv[1], sys.argv[2]
extra = dict(moe_cache_rate=0.15) if strategy == "offload" else {}
e = LLMEngine(EngineConfig(model=model, moe_strategy=strategy, **extra))
e.add_request(list(range(1, 20)), SamplingParams(max_tokens=400, ignore_eos=True))
for _ in range(20):
    e.step()
torch.cuda.synchronize()
t = time.perf_counter()
for _ in range(30):
    e.step()
torch.cuda.synchronize()
print(f"{strategy}: {30 / (time.perf_counter() - t):.1f} tok/s unprofiled")
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(10):
        e.step()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25))
