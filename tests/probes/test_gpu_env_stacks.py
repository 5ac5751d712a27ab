"""GPU probe without a GPU, the environment collector's redaction, py-spy's record shape."""

import json

import pytest

from ft.probes import env, gpu, stacks
from tests.conftest import ft_env, run_ft


def test_gpu_probe_reports_unavailable_with_a_reason():
    probe = gpu.GpuProbe()
    if probe.available:
        pytest.skip("an NVIDIA GPU is present")
    sample = probe.sample()
    assert sample["available"] is False and sample["reason"] and sample["devices"] == []


def test_pcie_link_bandwidth():
    assert gpu.pcie_link_gbs(3, 16) == pytest.approx(15.76)
    assert gpu.pcie_link_gbs(5, 16) == pytest.approx(63.0, rel=1e-3)
    assert gpu.pcie_link_gbs(None, 16) is None


def test_relevant_env_redacts_secrets_and_drops_the_rest():
    found = env.relevant_env(
        {"FT_API_KEY": "s3", "HF_TOKEN": "s4", "OMP_NUM_THREADS": "4", "HOME": "/root"}
    )
    assert found == {"FT_API_KEY": "<redacted>", "HF_TOKEN": "<redacted>", "OMP_NUM_THREADS": "4"}


@pytest.mark.timeout(120)
def test_ft_env_json_redacts_secrets():
    proc = run_ft("env", "--json", env=ft_env(MY_DB_PASSWORD="hunter2", CUDA_VISIBLE_DEVICES="0"))
    assert proc.returncode == 0, proc.stderr
    facts = json.loads(proc.stdout)
    assert "hunter2" not in proc.stdout
    assert facts["env"]["MY_DB_PASSWORD"] == "<redacted>"
    assert facts["env"]["CUDA_VISIBLE_DEVICES"] == "0"
    for key in ("ft", "python", "torch", "cpu_model", "physical_cores", "isa_flags", "numa_nodes"):
        assert key in facts
    assert "ptrace_scope" in facts


def test_pyspy_record_is_root_first_like_the_agents():
    dump = [
        {"thread_id": 1, "os_thread_id": 7, "thread_name": "MainThread", "active": True,
         "frames": [{"name": "leaf", "short_filename": "a.py", "line": 3},
                    {"name": "<module>", "short_filename": "a.py", "line": 9}]}
    ]  # fmt: skip
    rec = stacks.pyspy_record(7, dump)
    assert rec["source"] == "py-spy"
    assert rec["threads"][0]["frames"] == ["<module> (a.py:9)", "leaf (a.py:3)"]
    assert rec["threads"][0]["tid"] == 7


def test_pyspy_native_frames_stay_out_of_the_python_stack():
    libc = "/usr/lib/x86_64-linux-gnu/libc.so.6"
    dump = [
        {"thread_id": 1, "os_thread_id": 7, "thread_name": "MainThread", "active": True,
         "frames": [{"name": "0x7f98194d0b46", "short_filename": "[vdso]", "module": "[vdso]"},
                    {"name": "clock_gettime", "short_filename": "libc.so.6", "module": libc},
                    {"name": "spin", "short_filename": "a.py", "line": 3, "module": None},
                    {"name": "<module>", "short_filename": "a.py", "line": 9}]}
    ]  # fmt: skip
    th = stacks.pyspy_record(7, dump)["threads"][0]
    assert th["frames"] == ["<module> (a.py:9)", "spin (a.py:3)"]
    assert th["native"][-2:] == ["clock_gettime (libc.so.6:0)", "0x7f98194d0b46 ([vdso]:0)"]
    assert len(th["native"]) == 4


def fake_nvml(util: int = 0, rx_kbs: int = 12_000_000):
    """A stand-in pynvml: one gen-3 x16 board, so the GPU path runs on a CPU-only box."""
    from types import SimpleNamespace as NS

    def throughput(handle, counter):
        if counter == "rx":
            return rx_kbs
        raise RuntimeError("not supported")  # TX unsupported: that field reads None

    return NS(
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: 1,
        nvmlDeviceGetHandleByIndex=lambda i: f"h{i}",
        nvmlDeviceGetName=lambda h: "Fake RTX 24GB",
        nvmlDeviceGetUtilizationRates=lambda h: NS(gpu=util, memory=0),
        nvmlDeviceGetMemoryInfo=lambda h: NS(used=21_962 * 2**20, total=24_576 * 2**20),
        nvmlDeviceGetClockInfo=lambda h, clock: 2100,
        nvmlDeviceGetCurrPcieLinkGeneration=lambda h: 3,
        nvmlDeviceGetCurrPcieLinkWidth=lambda h: 16,
        nvmlDeviceGetPcieThroughput=throughput,
        nvmlSystemGetDriverVersion=lambda: "580.1",
        NVML_PCIE_UTIL_RX_BYTES="rx",
        NVML_PCIE_UTIL_TX_BYTES="tx",
        NVML_CLOCK_SM="sm",
    )


def test_gpu_probe_reads_every_field_through_nvml(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "pynvml", fake_nvml(util=7))
    probe = gpu.GpuProbe()
    (device,) = probe.sample()["devices"]
    assert probe.available and probe.driver() == "580.1"
    assert device["util_pct"] == 7 and device["mem_used_mib"] == 21_962
    assert (device["pcie_gen"], device["pcie_width"], device["sm_clock_mhz"]) == (3, 16, 2100)
    assert device["pcie_rx_bytes_s"] == 12_000_000 * 1024 and device["pcie_tx_bytes_s"] is None


def test_fetch_bound_from_a_real_probe_sample(monkeypatch):
    from ft.diagnose.findings import fetch_bound
    from ft.diagnose.summary import summarize

    monkeypatch.setitem(__import__("sys").modules, "pynvml", fake_nvml(util=3))
    samples = [gpu.GpuProbe().sample() for _ in range(3)]
    (finding,) = fetch_bound(summarize(samples))
    assert finding.evidence["pcie_gen"] == 3 and finding.evidence["pcie_rx_gbs"] > 12


def test_light_collect_reads_torchs_version_without_importing_it():
    import torch

    assert env.collect(light=True)["torch"] == torch.__version__


def test_gpu_probe_given_a_pid_samples_only_the_gpus_its_tree_uses(monkeypatch):
    import os
    from types import SimpleNamespace as NS

    nv = fake_nvml()
    nv.nvmlDeviceGetCount = lambda: 2
    on = {"h0": [NS(pid=1)], "h1": [NS(pid=os.getpid())]}  # another job on 0, the target on 1
    nv.nvmlDeviceGetComputeRunningProcesses = lambda h: on[h]
    monkeypatch.setitem(__import__("sys").modules, "pynvml", nv)
    sample = gpu.GpuProbe(os.getpid()).sample()
    assert [d["index"] for d in sample["devices"]] == [1] and sample["target_devices"] == [1]
    on["h1"] = []  # no context yet (or pids NVML cannot see): every GPU, as without a pid
    assert [d["index"] for d in gpu.GpuProbe(os.getpid()).sample()["devices"]] == [0, 1]
    assert [d["index"] for d in gpu.GpuProbe().sample()["devices"]] == [0, 1]
