"""Per-GPU memory and step-time model for transformer training under DP, ZeRO-1, TP and PP.

A pure function of model dims, layout and hardware numbers (no torch). Formulas, per GPU, with
P = parameters, mixed precision (fp16 weights/grads, fp32 master + Adam/LAMB moments):

  weights      2 P / (tp pp)                     fp16 copy used by forward/backward
  grads        2 P / (tp pp)
  optimizer   12 P / (tp pp [dp if ZeRO-1])      fp32 master, m, v
  activations  L/pp * s b d (34 + 5 a s / d) / tp bytes  (Korthikanti et al. 2022, fp16, no
               recompute, tp without sequence parallel approximated as all terms / tp);
               1F1B keeps pp micro-batches in flight on stage 0
  compute      (6 P + 12 L s d) tokens / (peak * efficiency)          (fwd + bwd, attention scores)
  DP/ZeRO-1    ring all-reduce (or reduce-scatter + all-gather, same bytes) of 2 P/(tp pp) bytes,
               hierarchical: intra-node ring over NVSwitch, then the 1/g-th share across nodes over
               the node's InfiniBand split between its g GPUs; once per optimizer step
  TP           4 all-reduces of s b d * 2 bytes per layer per micro-batch (2 fwd, 2 bwd), intra-node
  PP           bubble fraction (pp - 1) / (m + pp - 1) of compute; activation sends negligible
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelDims:
    n_layer: int
    d_model: int
    n_head: int
    vocab: int
    seq: int
    d_ff: int | None = None

    @property
    def params(self) -> int:
        d, ff = self.d_model, self.d_ff or 4 * self.d_model
        per_layer = 4 * d * d + 4 * d + 2 * d * ff + ff + d + 4 * d  # attn, mlp, 2 LayerNorms
        return self.n_layer * per_layer + self.vocab * d + self.seq * d + 2 * d


@dataclass(frozen=True)
class Hardware:
    """Defaults: DGX-2 (16x V100 32GB, NVSwitch) nodes joined by 8x100Gb/s InfiniBand each."""

    gpus_per_node: int = 16
    memory_gb: float = 32.0
    peak_tflops: float = 125.0  # V100 fp16 tensor cores
    efficiency: float = 0.35  # fraction of peak a BERT/GPT step reaches (stated assumption)
    intra_gbps: float = 150.0  # GB/s per GPU over NVSwitch (6 NVLink2 x 25 GB/s)
    inter_gbps_per_node: float = 100.0  # GB/s per node: 8 x 100 Gb/s
    reserved_gb: float = 2.0  # CUDA context, allocator fragmentation, workspace


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero1: bool = False
    microbatches: int = 1
    grad_accum: int = 1


def memory_gb(m: ModelDims, lay: Layout, batch: int) -> dict[str, float]:
    """Per-GPU bytes (GB) for a per-GPU micro-batch `batch` (samples per forward)."""
    shard = m.params / (lay.tp * lay.pp)
    act_per_layer = m.seq * batch * m.d_model * (34 + 5 * m.n_head * m.seq / m.d_model) / lay.tp
    in_flight = min(lay.pp, lay.microbatches) if lay.pp > 1 else 1
    out = {
        "weights": 2 * shard,
        "grads": 2 * shard,
        "optimizer": 12 * shard / (lay.dp if lay.zero1 else 1),
        "activations": m.n_layer / lay.pp * act_per_layer * in_flight,
    }
    out = {k: v / 1e9 for k, v in out.items()}
    out["total"] = sum(out.values())
    return out


def max_batch(m: ModelDims, lay: Layout, hw: Hardware = Hardware()) -> int:
    """Largest per-GPU micro-batch whose memory fits in the GPU (minus `reserved_gb`)."""
    b = 0
    while memory_gb(m, lay, b + 1)["total"] <= hw.memory_gb - hw.reserved_gb:
        b += 1
    return b


def _allreduce_s(nbytes: float, n_gpus: int, hw: Hardware) -> float:
    g = min(n_gpus, hw.gpus_per_node)
    nodes = max(1, n_gpus // hw.gpus_per_node)
    t = 2 * (g - 1) / g * nbytes / (hw.intra_gbps * 1e9) if g > 1 else 0.0
    if nodes > 1:
        t += 2 * (nodes - 1) / nodes * (nbytes / g) / (hw.inter_gbps_per_node * 1e9 / g)
    return t


def step_time(m: ModelDims, lay: Layout, batch: int, hw: Hardware = Hardware()) -> dict[str, float]:
    """Seconds per optimizer step and samples/s over the whole job; `batch` = per-GPU micro-batch."""
    samples_per_rank = batch * lay.grad_accum * max(1, lay.microbatches if lay.pp > 1 else 1)
    tokens = samples_per_rank * m.seq
    flops = (6 * m.params + 12 * m.n_layer * m.seq * m.d_model) * tokens / (lay.tp * lay.pp)
    compute = flops / (hw.peak_tflops * 1e12 * hw.efficiency)
    if lay.pp > 1:
        compute *= 1 + (lay.pp - 1) / lay.microbatches
    dp_bytes = 2 * m.params / (lay.tp * lay.pp)
    dp_comm = _allreduce_s(dp_bytes, lay.dp * lay.tp, hw) if lay.dp > 1 else 0.0
    tp_comm = 0.0
    if lay.tp > 1:
        per = m.seq * batch * m.d_model * 2
        n_micro = samples_per_rank / batch
        tp_comm = 4 * m.n_layer / lay.pp * n_micro * 2 * (lay.tp - 1) / lay.tp * per / (hw.intra_gbps * 1e9)
    # DDP overlaps the all-reduce with backward (~2/3 of compute); only the excess is exposed
    exposed_dp = max(0.0, dp_comm - compute * 2 / 3 / lay.grad_accum)
    total = compute + tp_comm + exposed_dp
    return {
        "compute_s": compute,
        "dp_comm_s": dp_comm,
        "tp_comm_s": tp_comm,
        "step_s": total,
        "dp_bytes": dp_bytes,
        "samples_per_s": samples_per_rank * lay.dp / total,
    }


BERT_LARGE = dict(n_layer=24, d_model=1024, n_head=16, vocab=30522)
GPT2_MEDIUM = dict(n_layer=24, d_model=1024, n_head=16, vocab=50257)


def table(model: dict, seq: int, layouts: dict[str, Layout], hw: Hardware = Hardware()) -> str:
    """A markdown table: per-GPU memory at the largest batch that fits, and job throughput on 64 GPUs."""
    m = ModelDims(seq=seq, **model)
    rows = [
        "| layout | max batch/GPU | weights GB | grads GB | optim GB | activ. GB | step s | DP comm s | samples/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, lay in layouts.items():
        b = max_batch(m, lay, hw)
        mem, t = memory_gb(m, lay, b), step_time(m, lay, b, hw)
        rows.append(
            f"| {name} | {b} | {mem['weights']:.2f} | {mem['grads']:.2f} | {mem['optimizer']:.2f} | "
            f"{mem['activations']:.1f} | {t['step_s']:.3f} | {t['dp_comm_s']:.3f} | {t['samples_per_s']:.0f} |"
        )
    return "\n".join(rows)
