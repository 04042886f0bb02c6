

def test_workers_keep_torchs_inductor_cache_apart_per_simulated_isa(monkeypatch):
    """torch 2.13 keys its Inductor cache without the vector ISA: a simulated-AVX2 run's C++ loaded by a native run
    corrupted the heap of the torch.compile workers. The workers of a run with ATEN_CPU_CAPABILITY use their own."""
    from graphtrain.bench.worker import worker_env
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    assert "TORCHINDUCTOR_CACHE_DIR" not in worker_env()
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert worker_env()["TORCHINDUCTOR_CACHE_DIR"].endswith("-isa-avx2")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere")  # the user's choice stands
    assert worker_env()["TORCHINDUCTOR_CACHE_DIR"] == "/somewhere"
