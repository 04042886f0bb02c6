"""The cost model against hand-computed values (no processes spawned)."""

from graphtrain.distributed.cost_model import BERT_LARGE, Layout, ModelDims, memory_gb, step_time


def test_bert_large_parameter_count_and_memory_by_hand():
    m = ModelDims(seq=128, **BERT_LARGE)
    # 24 * (4*1024^2 + 4*1024 + 2*1024*4096 + 4096 + 1024 + 4*1024) + 30522*1024 + 128*1024 + 2*1024
    assert m.params == 24 * 12_596_224 + 31_254_528 + 131_072 + 2048 == 333_697_024
    dp = memory_gb(m, Layout(dp=64), batch=0)
    assert abs(dp["optimizer"] - 12 * 333_697_024 / 1e9) < 1e-9  # 4.004 GB: fp32 master + m + v
    zero = memory_gb(m, Layout(dp=64, zero1=True), batch=0)
    assert abs(zero["optimizer"] - dp["optimizer"] / 64) < 1e-9
    # activations: 24 layers * 128*1*1024*(34 + 5*16*128/1024) bytes = 24 * 5,767,168
    assert abs(memory_gb(m, Layout(), batch=1)["activations"] - 24 * 5_767_168 / 1e9) < 1e-9


def test_allreduce_time_by_hand():
    m = ModelDims(seq=128, **BERT_LARGE)
    t = step_time(m, Layout(dp=64), batch=1)
    g = 2 * 333_697_024  # fp16 gradient bytes
    intra = 2 * 15 / 16 * g / 150e9
    inter = 2 * 3 / 4 * (g / 16) / (100e9 / 16)
    assert abs(t["dp_comm_s"] - (intra + inter)) < 1e-12
