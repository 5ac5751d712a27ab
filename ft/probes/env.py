"""The machine a report came from, collect_env style; secrets in environment variables redacted."""

from __future__ import annotations

import os
import platform
import re
import sys
from pathlib import Path

from ft import __version__, cpuinfo
from ft.probes.gpu import GpuProbe
from ft.probes.stacks import ptrace_scope

ENV_PREFIXES = (
    "FT_",
    "CUDA_",
    "OMP_",
    "MKL_",
    "TORCH_",
    "PYTORCH_",
    "NCCL_",
    "NVIDIA_",
    "KMP_",
    "GOMP_",
)
ENV_NAMES = (
    "LD_LIBRARY_PATH",
    "LD_PRELOAD",
    "PYTHONPATH",
    "VIRTUAL_ENV",
    "TRITON_CACHE_DIR",
    "HF_HOME",
)
SECRET = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH", re.IGNORECASE)
REDACTED = "<redacted>"
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni",
             "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve")  # fmt: skip


def relevant_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Variables that change how ft, torch, CUDA or OpenMP behave; secrets hidden."""
    environ = os.environ if environ is None else environ
    out = {}
    for name in sorted(environ):
        if name.startswith(ENV_PREFIXES) or name in ENV_NAMES or SECRET.search(name):
            out[name] = REDACTED if SECRET.search(name) else environ[name]
    return out


def git_commit() -> str | None:
    """The commit of the ft checkout this runs from (None for an installed wheel)."""
    try:
        import git

        repo = git.Repo(Path(__file__).resolve().parents[2])
        return repo.head.commit.hexsha + ("-dirty" if repo.is_dirty() else "")
    except Exception:
        return None


def numa_nodes() -> dict[str, str]:
    """NUMA node -> its CPU list, from sysfs."""
    nodes = {}
    for node in sorted(Path("/sys/devices/system/node").glob("node[0-9]*")):
        try:
            nodes[node.name] = (node / "cpulist").read_text().strip()
        except OSError:
            continue
    return nodes


def _torch_light() -> dict:
    """torch's version and CUDA build from torch/version.py, without importing torch (seconds)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("torch")
        path = Path(spec.submodule_search_locations[0]) / "version.py"
        facts: dict = {}
        exec(compile(path.read_text(), str(path), "exec"), facts)  # a file of constants
        return {"torch": facts["__version__"], "torch_cuda": facts.get("cuda")}
    except Exception as exc:
        return {"torch": f"unavailable ({type(exc).__name__})"}


def _torch(light: bool) -> dict:
    if light:
        return _torch_light()
    try:
        import torch
    except Exception as exc:
        return {"torch": f"unavailable ({exc})"}
    return {
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "torch_threads": torch.get_num_threads(),
    }


def _gpus() -> dict:
    probe = GpuProbe()
    try:
        sample = probe.sample()
        if not sample["available"]:
            return {"gpu": f"unavailable ({sample['reason']})"}
        keep = ("index", "name", "mem_total_mib", "pcie_gen", "pcie_width")
        return {
            "driver": probe.driver(),
            "gpus": [{k: d[k] for k in keep} for d in sample["devices"]],
        }
    finally:
        probe.close()


def collect(light: bool = False) -> dict:
    """Everything `ft env` prints; light=True skips importing torch (ft diagnose's own run)."""
    flags = cpuinfo.isa_flags()
    facts = {"ft": __version__, "ft_commit": git_commit(), "python": sys.version.split()[0]}
    facts |= {"platform": platform.platform(), "executable": sys.executable}
    facts |= _torch(light) | _gpus()
    facts |= {
        "cpu_model": cpuinfo.model_name(),
        "physical_cores": cpuinfo.physical_cores(),
        "logical_cpus": os.cpu_count(),
        "allowed_cores": len(cpuinfo.allowed_cores()),
        "isa": cpuinfo.best_isa(),
        "isa_flags": [f for f in ISA_FLAGS if f in flags],
        "numa_nodes": numa_nodes(),
        "ptrace_scope": ptrace_scope(),
        "env": relevant_env(),
    }
    return facts
