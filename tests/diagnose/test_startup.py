"""The engine's startup lines, parsed into the facts the findings use."""

from ft.diagnose.startup import parse, startup_lines

SEED_LOG = """INFO 11-29 09:00:00 Resolved config: moe_strategy='hybrid', expert_format='bf16', device='cuda'
INFO 11-29 09:00:01 --moe-hybrid-max-fetch auto: fetching 27.8% of each decode step's expert misses over PCIe (benched PCIe/CPU bandwidth ratio), the rest on the CPU
INFO 11-29 09:00:01 torch intra-op threads: 16 -> 1 (cores reserved for the pinned CPU MoE pool)
INFO 11-29 09:00:02 CPU MoE executor ready: threads=15 (pinned to cores 0..14) isa=avx2 fmt=bf16 H=2560
unrelated line
INFO 11-29 09:00:09 API server is ready to serve on 127.0.0.1:1919
"""  # noqa: E501


def test_seed_startup_lines():
    facts = parse(SEED_LOG)
    assert facts["strategy"] == "hybrid" and facts["expects_cpu_pool"] is True
    assert facts["hybrid_fetch_pct"] == 27.8 and facts["pool_threads"] == 15
    assert facts["pool_cores"] == "0..14" and facts["torch_threads"] == "16 -> 1"
    assert facts["ready"] == "127.0.0.1:1919" and facts["device"] == "cuda"
    assert len(startup_lines(SEED_LOG)) == 5


def test_offload_expects_no_pool_and_other_programs_say_nothing():
    assert (
        parse("Resolved config: moe_strategy='offload', device='cpu'")["expects_cpu_pool"] is False
    )
    assert parse("hello world\n") == {}
