"""Measure a training step's peak memory in a fresh subprocess (CPU: resident set; CUDA: allocator).

``python -m graphtrain.tools.measure --model gpt2-mini --seq 128 --batch 16 --mode graphtrain
--recompute none`` prints one JSON line. Modes: ``eager``, ``compile`` (torch.compile, Inductor),
``graphtrain`` (``engine.capture.compile_train_step``: the memory optimizer alone, no fusion passes) and
``accelerate`` (``graphtrain.accelerate(model, provider=..., recompute=..., memory_budget=...)``: the
whole engine with its default passes, what users run). Method on CPU: build the model and AdamW, run warm-up
steps (compile, optimizer state), then ``gc.collect()`` + glibc ``malloc_trim(0)``, note the
resident set, reset the kernel's high-water mark (``echo 5 > /proc/self/clear_refs``) and run the
timed steps. ``peak_rss`` is the absolute high-water mark of those steps (the figure the README and
docs/design/memory.md quote); ``peak_tensor_bytes`` subtracts what was resident before them but is not a tensor
(interpreter, libraries, compile caches), i.e. it is the step's peak counted the way ``predict_peak``
counts it. For ``accelerate`` the engine's prediction is also turned into a predicted process peak
(``memory.process.predict_process_peak``: the resident set before the timed steps, less the parameters,
optimizer state and batch measured in it, plus the predicted step peak) and compared with ``peak_rss``:
``process_peak_error`` = (predicted - measured) / measured.

Every mode runs under one allocator setting (``--allocator``, glibc's default unless given), recorded in the JSON
line as ``allocator``: a comparison of eager with graphtrain measures both under the same one, since the setting
alone moves a peak by 9-31% (docs/design/memory.md). Huge pages likewise (``--huge-pages``, recorded as
``huge_pages``): under glibc's default none (a user's eager loop has no graphtrain allocator), under ``keep`` or
``release`` the ones graphtrain chooses for the model (runtime/allocator.py huge_pages_as_graphtrain), the same for
every mode. Until 2026-12-01 every mode got huge pages, which round each 2 MiB+ block up to whole 2 MiB pages.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from typing import Any

from graphtrain.memory.allocator import block_cache_stats, trim
from graphtrain.memory.process import predict_process_peak, reset_peak_rss, rss_bytes

# Imports inside functions: order: the child process sets its allocator and thread settings from its arguments before
# torch allocates and the engine loads; the parent only starts children and reads their JSON.

MODES = ("eager", "compile", "graphtrain", "accelerate")


def _rss_kib(field: str = "VmRSS") -> int:
    b = rss_bytes(field)
    if b is None:
        raise RuntimeError(f"{field} not in /proc/self/status")
    return b // 1024


def _trim() -> None:
    gc.collect()
    trim()


def machine() -> str:
    """The CPU these figures come from: /proc/cpuinfo's model name, family and model, the cores, aten's ISA."""
    import torch

    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                k, _, v = line.partition(":")
                info.setdefault(k.strip(), v.strip())
    except OSError:
        pass
    return (
        f"{info.get('model name', 'unknown CPU')} (family {info.get('cpu family', '?')}, model "
        f"{info.get('model', '?')}), {os.cpu_count()} cores, aten ISA {torch.backends.cpu.get_cpu_capability()}, "
        f"torch {torch.__version__}"
    )


def build(model: str, seq: int, batch: int, dropout: float | None = None, attention: str = "sdpa") -> tuple[Any, tuple]:
    """A reference model and a batch; attention `sdpa` (F.scaled_dot_product_attention, what users write: the
    memory claims' baseline) or `explicit` (hand-written matmul-softmax-dropout-matmul)."""
    import torch

    from graphtrain.config.sections import ModelConfig
    from graphtrain.models import build_model

    if model.startswith("vit:"):  # a Hugging Face image classifier from a config.json: pixels in, the loss out
        return _vision(model[4:], batch, attention)
    if model.startswith("hf-lm:"):  # the Hugging Face language model itself: its output, logits included
        return _hf_language_model(model[6:], seq, batch, dropout, attention)
    if model.startswith("hf:"):  # a Hugging Face model from a local folder / config.json (model.hf)
        m = build_model(ModelConfig(hf=model[3:], dropout=dropout, attention=attention))
    else:
        m = build_model(ModelConfig(name=model, dropout=dropout, max_seq_len=max(seq, 64), attention=attention))
    m.train()
    g = torch.Generator().manual_seed(0)
    vocab = (
        m.spec.vocab_size
        if model.startswith("hf:")
        else m.get_input_embeddings().num_embeddings
        if hasattr(m, "get_input_embeddings")
        else 512
    )
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    if getattr(m, "family", "gpt2") == "bert" and not model.startswith("hf:"):  # BERT.forward(ids, mask, types, labels)
        return m, (ids, None, None, labels)
    return m, (ids, labels)


def _hf_language_model(path: str, seq: int, batch: int, dropout: float | None, attention: str) -> tuple[Any, dict]:
    """`hf-lm:PATH`: AutoModelForCausalLM (AutoModelForMaskedLM for an encoder: BERT, RoBERTa...) from PATH's
    config.json, random init, called as a user's loop calls it: ``out = model(input_ids=..., labels=...)``, the
    output (with its logits over the whole vocabulary) held until the backward is done, ``out.loss`` trained. Unlike
    `hf:` (graphtrain's model.hf wrapper, which returns the loss alone), the logits are an output of the step. Masked
    LM: 15% of the positions labelled. The batch is the keyword arguments (a dict)."""
    import torch
    import transformers

    from graphtrain.config.sections import ModelConfig
    from graphtrain.models.hf import configure

    cfg, objective = configure(ModelConfig(hf=path, dropout=dropout))  # model.hf's config overrides and objective
    cfg._attn_implementation = "sdpa" if attention == "sdpa" else "eager"
    masked = objective == "mlm"
    auto = transformers.AutoModelForMaskedLM if masked else transformers.AutoModelForCausalLM
    m = auto.from_config(cfg).train()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    labels = ids.clone()
    if masked:
        labels[torch.rand(batch, seq, generator=g) > 0.15] = -100
    return m, {"input_ids": ids, "labels": labels}


def _vision(path: str, batch: int, attention: str) -> tuple[Any, tuple]:
    """`vit:PATH`: AutoModelForImageClassification from PATH (a folder with config.json or the file), random init,
    called as model(pixel_values, labels) -> loss; --seq is ignored (the config's image size decides)."""
    import torch
    import transformers

    from graphtrain.models.hf import hf_folder

    class WithLoss(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return self.inner(pixel_values=pixel_values, labels=labels).loss

    _, config_file = hf_folder(path)
    cfg = transformers.AutoConfig.from_pretrained(str(config_file), local_files_only=True)
    cfg._attn_implementation = "sdpa" if attention == "sdpa" else "eager"
    m = WithLoss(transformers.AutoModelForImageClassification.from_config(cfg)).train()
    g = torch.Generator().manual_seed(0)
    pixels = torch.randn(batch, cfg.num_channels, cfg.image_size, cfg.image_size, generator=g)
    return m, (pixels, torch.randint(0, cfg.num_labels, (batch,), generator=g))


def _allocator(a: argparse.Namespace) -> str:
    """engine.cpu_allocator for this measurement's process (memory/allocator.py apply), the same for every mode
    unless a flag says otherwise, so that two modes compared run under one setting: `--allocator`, else release with
    --pin-malloc, keep with --keep-malloc, else glibc's default (what a user's eager loop runs under). What graphtrain
    itself would set (release under recompute and memory budgets, keep without: runtime/allocator.py allocator_mode) is
    one flag away, and a comparison gives that flag to eager too."""
    if a.allocator:
        return a.allocator
    return "release" if a.pin_malloc else "keep" if a.keep_malloc else "default"


def _pinned(a: argparse.Namespace) -> bool:
    """glibc's mmap threshold pinned in this measurement's process (the release setting)."""
    return _allocator(a) == "release"


def _huge_pages(a: argparse.Namespace, model: Any) -> bool:
    """Put this process's 2 MiB+ blocks on huge pages or not, the same whatever the mode (module docstring), and
    return whether they are on: `--huge-pages on/off`, else (auto) none under glibc's default and graphtrain's choice
    for `model` under keep or release."""
    from graphtrain.config.sections import EngineConfig
    from graphtrain.runtime.allocator import huge_pages_as_graphtrain

    if a.huge_pages == "auto" and _allocator(a) != "default":
        return huge_pages_as_graphtrain(model)
    return huge_pages_as_graphtrain(model, EngineConfig(cpu_huge_pages=a.huge_pages == "on"))  # forced: on or off


def _child(a: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(a.threads)
    from graphtrain.runtime.allocator import set_cpu_allocator

    # set here (accelerate keeps it); huge pages once the model is built (_huge_pages), as graphtrain decides them
    set_cpu_allocator(_allocator(a), huge_pages=False, block_cache=False if a.no_block_cache else None)
    base_kib = _rss_kib()
    if a.model.startswith("hf-lm:") and a.mode == "graphtrain":
        raise SystemExit(
            "--model hf-lm: takes --mode eager, compile or accelerate (graphtrain's own step needs a "
            "model that returns its loss: use hf:PATH)"
        )
    model, batch = build(a.model, a.seq, a.batch, a.dropout, a.attention)
    huge_pages = _huge_pages(a, model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)  # the strongest one-flag setting, every variant
    if a.mode == "eager":
        step_fn = model
    elif a.mode == "compile":
        step_fn = torch.compile(model)
    elif a.mode == "accelerate":
        from graphtrain.frontend.accelerate import accelerate

        step_fn = accelerate(model, provider=a.provider, recompute=a.recompute, memory_budget=a.budget)
    else:
        from graphtrain.config.sections import EngineConfig
        from graphtrain.frontend.capture import compile_train_step
        from graphtrain.passes.memory_inplace import inplace_elementwise_pass

        cfg = EngineConfig(recompute=a.recompute, memory_budget=a.budget)
        passes = [inplace_elementwise_pass] if a.inplace else []
        step_fn = compile_train_step(model, cfg, boxed=not a.unboxed, fw_passes=passes, bw_passes=passes)

    def step() -> float:
        if isinstance(batch, dict):  # hf-lm: the output object (logits too) lives until the backward is done
            out = step_fn(**batch)
            loss = out.loss
        else:
            loss = step_fn(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    tensors = list(batch.values()) if isinstance(batch, dict) else list(batch)

    saved_bytes = None
    for i in range(a.warmup):
        if i == a.warmup - 1 and a.mode in ("eager", "graphtrain", "accelerate"):
            saved_bytes = _saved_bytes(step, model)
        else:
            step()
    if a.mode == "accelerate" and a.provider == "auto":
        # provider auto's tiered compile: let the background Inductor compile finish and take the switching step
        # (it loads Inductor and times both providers), so the timed steps run on the provider the engine keeps.
        from graphtrain.frontend.accelerate import wait_compiled

        if wait_compiled(model):
            step()
    _trim()
    state = sum(t.numel() * t.element_size() for t in model.parameters())
    state += sum(
        t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)
    )
    state += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    rss0_kib = _rss_kib()
    # The prediction was made when the step compiled; its process peak needs only the baseline, taken here.
    process = None
    if a.mode == "accelerate":
        pred = _predicted_memory(model)
        if pred is not None:
            process = predict_process_peak(
                pred, model=model, optimizer=opt, batch=tensors, baseline_rss=rss0_kib * 1024
            )
    if not reset_peak_rss():
        raise RuntimeError("cannot reset the resident high-water mark (/proc/self/clear_refs)")
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    hwm = _rss_kib("VmHWM") * 1024
    times.sort()
    predicted, phases, chose, candidates = None, None, None, None
    if a.mode == "accelerate":
        from graphtrain.tools.report import report

        graphs = report(model).graphs
        step = _predicted_memory(model)
        if step is not None:
            predicted, phases = step["peak"], step["phase_totals"]
        if graphs and graphs[0].get("recompute"):
            r = graphs[0]["recompute"]
            chose = next((f"{c['name']}: {c['what']}" for c in r["choices"] if c["name"] == r["chosen"]), None)
            candidates = {c["name"]: c.get("predicted_peak") for c in r["choices"]}  # auto's evidence
    return {
        "model": a.model,
        "seq": a.seq,
        "batch": a.batch,
        "mode": a.mode,
        "recompute": a.recompute,
        "inplace": a.inplace,
        "boxed": not a.unboxed,
        "pinned_malloc": _pinned(a),
        "allocator": _allocator(a),
        "huge_pages": huge_pages,
        "base_rss": base_kib * 1024,
        "rss_before_steps": rss0_kib * 1024,
        "state_bytes": state,
        "peak_rss": hwm,
        "peak_tensor_bytes": hwm - (rss0_kib * 1024 - state),
        "step_s": times[len(times) // 2],
        "step_s_all": times,
        "saved_bytes": saved_bytes,
        "param_bytes": sum(t.numel() * t.element_size() for t in model.parameters()),
        "provider": a.provider if a.mode == "accelerate" else None,
        "predicted_peak": predicted,
        "predicted_phases": phases,
        "recompute_chose": chose,
        "recompute_candidates": candidates,
        "machine": machine(),
        "threads": a.threads,
        "predicted_process_peak": process.process_peak if process else None,
        "predicted_increment": process.increment if process else None,
        "measured_increment": hwm - rss0_kib * 1024,
        "block_cache": block_cache_stats(),
        "process_peak_error": process.relative_error(hwm) if process else None,
    }


def _predicted_memory(model: Any) -> dict | None:
    """The engine's step prediction for the accelerated model (as graphtrain.report shows it)."""
    from graphtrain.tools.report import step_prediction

    graphs = getattr(getattr(model, "_graphtrain", None), "graphs", None) or []
    return step_prediction(graphs, model)[0]


def _saved_bytes(step: Any, model: Any) -> int:
    """Run `step` once and return the bytes of distinct storages autograd saved for backward (eager's
    activations; for a compiled step, what its forward graph returns for the backward), parameters
    and their views (a linear saves weight.t()) excluded."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            if st.data_ptr() not in params:
                seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(seen.values())


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--model",
        default="gpt2-mini",
        help="a preset; hf:PATH (graphtrain's model.hf wrapper: the loss alone); hf-lm:PATH (the Hugging "
        "Face language model itself, its logits an output); vit:PATH (an image classifier)",
    )
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--mode", choices=MODES, default="graphtrain")
    p.add_argument("--recompute", default="none", choices=("none", "selective", "full", "auto"))
    p.add_argument("--budget", type=float, default=None, help="memory_budget for recompute=auto (bytes)")
    p.add_argument("--provider", default="aten", choices=("aten", "inductor", "auto"), help="accelerate mode only")
    p.add_argument("--inplace", action="store_true", help="run the in-place elementwise pass")
    p.add_argument("--unboxed", action="store_true", help="hold backward inputs until it returns")
    p.add_argument(
        "--allocator",
        choices=("default", "keep", "release"),
        default=None,
        help="engine.cpu_allocator in this process, whatever the mode (default: glibc's default for every "
        "mode; give every mode of a comparison the same value)",
    )
    p.add_argument("--pin-malloc", action="store_true", help="the same as --allocator release")
    p.add_argument("--no-pin-malloc", action="store_true", help="the same as --allocator default (the default)")
    p.add_argument(
        "--keep-malloc",
        action="store_true",
        help="glibc keeps freed blocks for the next step (engine.cpu_allocator keep, what graphtrain sets "
        "without recompute) whatever the recompute mode",
    )
    p.add_argument(
        "--no-block-cache",
        action="store_true",
        help="under release, return every freed block to the OS (engine.cpu_block_cache false)",
    )
    p.add_argument(
        "--huge-pages",
        choices=("auto", "on", "off"),
        default="auto",
        help="2 MiB+ blocks on transparent huge pages, the same for every mode (auto: none under glibc's default "
        "allocator, as a user's eager loop runs; under keep or release the ones graphtrain chooses for the model)",
    )
    p.add_argument("--dropout", type=float, default=None)
    p.add_argument(
        "--attention",
        choices=("sdpa", "explicit"),
        default="sdpa",
        help="the reference model's attention: SDPA (what users write) or hand-written",
    )
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    return p


def measure(timeout: float = 1800, **kw: Any) -> dict[str, Any]:
    """Run one measurement in a fresh subprocess; kw are the CLI flags (inplace=True, etc.)."""
    args = [sys.executable, "-m", "graphtrain.tools.measure"]
    for k, v in kw.items():
        if v is None or v is False:
            continue
        args += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    r = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)
    if r.returncode != 0:
        return {"error": (r.stderr or r.stdout)[-2000:], "returncode": r.returncode, **kw}
    return json.loads(r.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    print(json.dumps(_child(_parser().parse_args())))
