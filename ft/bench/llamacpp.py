"""llama.cpp as a peer: a given build (its llama-bench, llama-quantize and source tree), the
checkpoint converted to GGUF by llama.cpp's own converter, the placements of its MoE offload
flags under a GPU memory budget, and llama-bench's JSON read back.

The placements, at batch 1 (llama-bench -p 0 -n N):
    gpu        -ngl 99                       every weight on the GPU
    n-cpu-moe  -ngl 99 --n-cpu-moe N         experts of the first N layers on the CPU; N is the
                                             fewest that fit the budget (`n_cpu_moe`)
    exps-cpu   -ngl 99 -ot exps=CPU          every routed expert on the CPU
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ft.errors import FtError

GIB = 2**30
# ft's expert format -> the GGUF type it is set beside (a float32 checkpoint's bf16: `gguf_type`)
GGUF_TYPES = {"bf16": "bf16", "int8": "q8_0"}
_EXPERT_TENSOR = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down|gate_up)_exps\.")
# The synthetic tokenizer is ft's own byte-level BPE, whose pre-tokenizer hash the converter does
# not know; the engines are compared on token ids, so the GGUF only needs a valid pre-tokenizer
# name. A real checkpoint's hash is recognised first and keeps its own name.
_CONVERT = """
import runpy, sys
src = sys.argv[1]
sys.path[:0] = [src + "/gguf-py", src]
from conversion.base import TextModel
known = TextModel.get_vocab_base_pre
def named(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        return "qwen2"
TextModel.get_vocab_base_pre = named
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
runpy.run_path(src + "/convert_hf_to_gguf.py", run_name="__main__")
"""


@dataclass(frozen=True)
class LlamaCpp:
    source: Path  # the source tree: convert_hf_to_gguf.py, gguf-py/, include/
    bin: Path  # llama-bench, llama-quantize

    @classmethod
    def at(cls, build: str | Path, source: str | Path | None = None) -> LlamaCpp:
        """A CMake build folder (or its bin/); the source tree from its CMakeCache unless given."""
        build = Path(build)
        bin_dir = next((d for d in (build / "bin", build) if (d / "llama-bench").is_file()), None)
        if bin_dir is None:
            raise FtError(f"no llama-bench in {build}/bin or {build}: build it first "
                          "(cmake --build BUILD --target llama-bench llama-quantize)")  # fmt: skip
        src = Path(source) if source else _source_from_cache(bin_dir)
        if src is None or not (src / "convert_hf_to_gguf.py").is_file():
            raise FtError(f"no llama.cpp source tree with convert_hf_to_gguf.py at {src}: "
                          "give it with --llamacpp-src")  # fmt: skip
        return cls(src, bin_dir)

    def tool(self, name: str) -> Path | None:
        path = self.bin / name
        return path if path.is_file() else None


def _source_from_cache(bin_dir: Path) -> Path | None:
    for cache in (bin_dir / "CMakeCache.txt", bin_dir.parent / "CMakeCache.txt"):
        if cache.is_file():
            found = re.search(r"^CMAKE_HOME_DIRECTORY:INTERNAL=(.+)$", cache.read_text(), re.M)
            return Path(found.group(1)) if found else None
    return None


def gguf_type(fmt: str, checkpoint_dtype: str | None) -> str:
    """The GGUF type set beside ft's expert format: float32 checkpoints keep f32 for the
    unquantised pair, so that the two engines' outputs differ only by summation order."""
    if fmt == "bf16" and checkpoint_dtype == "float32":
        return "f32"
    return GGUF_TYPES[fmt]


def gguf_path(model: str | Path, gguf_type: str, cache: Path) -> Path:
    """Where a checkpoint's GGUF of one type is cached: named by the checkpoint folder, keyed by
    its resolved path so two checkpoints of one name do not share a file."""
    model = Path(model).resolve()
    key = hashlib.sha1(str(model).encode()).hexdigest()[:8]
    return cache / f"{model.name}-{key}-{gguf_type}.gguf"


def convert(lc: LlamaCpp, model: str | Path, gguf_type: str, cache: Path, log=print) -> Path:
    """The checkpoint as GGUF of `gguf_type` (f32, bf16, q8_0), converted once and reused while
    it is newer than the checkpoint. Q8_0 comes from the bf16 GGUF via llama-quantize."""
    out = gguf_path(model, gguf_type, cache)
    if out.is_file() and out.stat().st_mtime >= _newest(Path(model)):
        return out
    cache.mkdir(parents=True, exist_ok=True)
    part = out.with_name(out.name + ".part")
    quantize = lc.tool("llama-quantize")
    if gguf_type == "q8_0" and quantize:
        bf16 = convert(lc, model, "bf16", cache, log)
        log(f"llama-quantize {bf16.name} -> Q8_0")
        _check_run([str(quantize), str(bf16), str(part), "Q8_0"], "llama-quantize")
    else:
        log(f"convert_hf_to_gguf.py {model} --outtype {gguf_type}")
        cmd = [sys.executable, "-c", _CONVERT, str(lc.source), str(model),
               "--outtype", gguf_type, "--outfile", str(part)]  # fmt: skip
        _check_run(cmd, "convert_hf_to_gguf.py")
    os.replace(part, out)
    return out


def _newest(model: Path) -> float:
    return max(p.stat().st_mtime for p in model.iterdir() if p.is_file())


def _check_run(cmd: list[str], what: str) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise FtError(f"{what} failed (exit {proc.returncode}): {tail[0]}")
    return proc.stdout


@dataclass(frozen=True)
class GgufSizes:
    dense: int  # bytes of every tensor that is not a routed expert
    experts: tuple[int, ...]  # routed-expert bytes of each layer

    @property
    def total(self) -> int:
        return self.dense + sum(self.experts)


def gguf_sizes(lc: LlamaCpp, path: Path) -> GgufSizes:
    """Tensor bytes of a GGUF, read with the gguf-py of the same llama.cpp tree."""
    reader = _gguf(lc).GGUFReader(str(path))
    return sizes_of((t.name, int(t.n_bytes)) for t in reader.tensors)


def sizes_of(tensors) -> GgufSizes:
    """(name, bytes) pairs -> dense bytes and routed-expert bytes per layer."""
    dense, per_layer = 0, {}
    for name, nbytes in tensors:
        found = _EXPERT_TENSOR.match(name)
        if found:
            layer = int(found.group(1))
            per_layer[layer] = per_layer.get(layer, 0) + nbytes
        else:
            dense += nbytes
    layers = max(per_layer, default=-1) + 1
    return GgufSizes(dense, tuple(per_layer.get(i, 0) for i in range(layers)))


def _gguf(lc: LlamaCpp):
    path = str(lc.source / "gguf-py")
    if path not in sys.path:
        sys.path.insert(0, path)  # the reader of the same tree that wrote the file
    import gguf

    return gguf


def n_cpu_moe(sizes: GgufSizes, budget_gib: float, margin_gib: float = 1.0) -> int | None:
    """The fewest leading layers whose experts go to the CPU (`--n-cpu-moe N`) for the rest to
    fit `budget_gib` with `margin_gib` kept free (ft's --moe-cache-auto margin, which covers
    llama.cpp's KV cache and compute buffers at batch 1); None: not even the dense part fits."""
    room = budget_gib * GIB - margin_gib * GIB - sizes.dense
    on_gpu = sum(sizes.experts)
    for n in range(len(sizes.experts) + 1):
        if on_gpu <= room:
            return n
        if n < len(sizes.experts):
            on_gpu -= sizes.experts[n]
    return None


def placements(sizes: GgufSizes, budget_gib: float | None) -> list[tuple[str, list[str]]]:
    """(name, llama-bench arguments) of each placement this budget calls for."""
    if budget_gib is None:
        return [("gpu", ["-ngl", "99"])]
    rows = []
    n = n_cpu_moe(sizes, budget_gib)
    if n is not None:
        rows.append((f"n-cpu-moe {n}", ["-ngl", "99", "--n-cpu-moe", str(n)]))
    rows.append(("exps-cpu", ["-ngl", "99", "-ot", "exps=CPU"]))
    return rows


def llama_bench(lc: LlamaCpp, gguf: Path, args: list[str], tokens: int, reps: int,
                threads: int | None = None) -> dict:  # fmt: skip
    """One llama-bench decode run (batch 1, no prompt): its JSON result row."""
    cmd = [str(lc.tool("llama-bench")), "-m", str(gguf), "-p", "0", "-n", str(tokens),
           "-r", str(reps), "-o", "json", *args]  # fmt: skip
    if threads:
        cmd += ["-t", str(threads)]
    rows = parse_llama_bench(_check_run(cmd, "llama-bench"))
    if len(rows) != 1:
        raise FtError(f"llama-bench gave {len(rows)} results for one setting, expected 1")
    return rows[0]


_KEPT = ("build_commit", "cpu_info", "gpu_info", "backends", "model_type", "model_size",
         "n_threads", "n_gpu_layers", "n_cpu_moe", "tensor_buft_overrides", "flash_attn",
         "n_prompt", "n_gen", "avg_ts", "stddev_ts", "samples_ts")  # fmt: skip


def parse_llama_bench(text: str) -> list[dict]:
    """llama-bench `-o json` output -> its decode rows (n_prompt 0), the fields the table uses."""
    try:
        data = json.loads(text)
    except ValueError:
        raise FtError("llama-bench's output is not JSON (was it run with -o json?)") from None
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise FtError("llama-bench's JSON is not a list of result objects")
    rows = []
    for row in data:
        missing = [k for k in ("n_gen", "avg_ts", "samples_ts") if k not in row]
        if missing:
            raise FtError(f"llama-bench result without {', '.join(missing)}")
        if row.get("n_prompt", 0) == 0 and row["n_gen"] > 0:
            rows.append({k: row.get(k) for k in _KEPT})
    return rows


def greedy_ids(lc: LlamaCpp, gguf: Path, prompt: list[int], n: int, ngl: int = 99) -> list[int]:
    """llama.cpp's greedy continuation of token ids (no tokenizer on either side): a small
    program on libllama, compiled once next to the build's binaries."""
    exe = _greedy_program(lc)
    ids = ",".join(str(i) for i in prompt)
    out = _check_run([str(exe), str(gguf), str(n), str(ngl), ids], "llamacpp_greedy")
    return json.loads(out.strip().splitlines()[-1])["ids"]


_GREEDY_SRC = Path(__file__).with_name("llamacpp_greedy.cpp")


def _greedy_program(lc: LlamaCpp) -> Path:
    exe = lc.bin / "ft-llamacpp-greedy"
    if exe.is_file() and exe.stat().st_mtime >= _GREEDY_SRC.stat().st_mtime:
        return exe
    cmd = ["c++", "-O2", "-std=c++17", str(_GREEDY_SRC), "-o", str(exe),
           f"-I{lc.source / 'include'}", f"-I{lc.source / 'ggml' / 'include'}",
           f"-L{lc.bin}", f"-Wl,-rpath,{lc.bin}", "-lllama"]  # fmt: skip
    _check_run(cmd, "compiling ft/bench/llamacpp_greedy.cpp")
    return exe
