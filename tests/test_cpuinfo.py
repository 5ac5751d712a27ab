from ft import cpuinfo


def test_cpu_facts_are_consistent():
    assert cpuinfo.physical_cores() >= 1
    allowed = cpuinfo.allowed_cores()
    assert allowed == sorted(allowed) and len(allowed) >= 1
    assert cpuinfo.best_isa()
    assert isinstance(cpuinfo.model_name(), str)
