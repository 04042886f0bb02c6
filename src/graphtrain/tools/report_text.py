"""The engine report as text: the one-screen headline, the details graph by graph and pass by pass, and the
two-line summary for the end of a run. Each function takes a ``Report`` (tools/report.py, which gathers the facts)
and only formats them; nothing here reads the engine's state.
"""

from __future__ import annotations

from typing import Any


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def _recompute_lines(r: dict[str, Any]) -> list[str]:
    """A RecomputeRecord (as a dict): the mode, each candidate partition tried, the one kept."""
    budget = f", budget {_mib(r['budget'])}" if r.get("budget") else ""
    L = [
        f"    recompute: mode {r['mode']}{budget}, chose {r['chosen']}; dropout outputs rebuilt from saved masks: "
        f"{r['dropout_rewrites']}; fused dropouts recomputed from their seed: {r.get('seeded_dropouts', 0)}; "
        f"dead random ops dropped from backward: {r['dead_random_dropped']}"
    ]
    for c in r["choices"]:
        ops = ", ".join(f"{k} x{v}" for k, v in sorted(c["recomputed_ops"].items(), key=lambda kv: -kv[1])[:8])
        peak = (
            ""
            if c["predicted_peak"] is None
            else f", predicted peak {_mib(c['predicted_peak'])}"
            + ("" if c["fits"] is None else (" (fits)" if c["fits"] else " (over budget)"))
        )
        L.append(
            f"      {'*' if c['name'] == r['chosen'] else ' '} {c['name']}: saves {_mib(c['saved_bytes'])} "
            f"for backward ({_mib(c['bytes_saved'])} less than none), +{c['flops_added'] / 1e6:,.2f} MFLOP "
            f"recomputed{peak}" + (f" ({c['what']})" if c.get("what") else "") + (f"; recomputes {ops}" if ops else "")
        )
    return L


def _memory_lines(m: dict[str, Any]) -> list[str]:
    """predict_peak's estimate of a training step through this graph, by component."""
    parts = [
        ("params", "params"),
        ("grads", "grads"),
        (f"{m['optimizer']} state", "optimizer_state"),
        ("batch", "batch_inputs"),
        ("saved activations", "saved_activations"),
        ("forward graph peak", "forward_graph_peak"),
        ("backward graph peak", "backward_graph_peak"),
        ("optimizer temporaries", "optimizer_temp"),
    ]
    at = m["peak_node"].get(m["peak_phase"])
    return [
        f"    predicted step peak: {_mib(m['peak'])} in {m['peak_phase']}"
        + (f" (at {at})" if at else "")
        + "; "
        + ", ".join(f"{label} {_mib(m[k])}" for label, k in parts),
        "      by phase: " + ", ".join(f"{k} {_mib(v)}" for k, v in m["phase_totals"].items()),
    ]


def _process_lines(p: dict[str, Any]) -> list[str]:
    """ProcessPeak.to_dict(): the step peak put on top of what is resident now and not predicted."""
    opt = (
        ""
        if p["optimizer_measured"]
        else (
            " (optimizer state not measured, counted as not yet allocated: an upper "
            "bound once it exists; pass graphtrain.report(model, optimizer=opt))"
        )
    )
    return [
        f"    predicted process peak (next step, peak RSS): {_mib(p['process_peak'])} = resident now "
        f"{_mib(p['baseline_rss'])} - the step's tensors already in it {_mib(p['resident_state'])} + predicted "
        f"step peak {_mib(p['step_peak'])}" + opt
    ]


def allocator_line(a: dict[str, Any]) -> str:
    line = f"CPU allocator: {a['mode']}, huge pages {'on' if a['huge_pages'] else 'off'}"
    c = a.get("block_cache")
    if a.get("block_cache_error"):
        return line + f", block cache on (counters unavailable: {a['block_cache_error']})"
    if c is None:
        return line + ", no block cache"
    return (
        line + f", block cache {c['hits']:,} hits, {c['misses']:,} misses, {_mib(c['cached_bytes'])} cached, "
        f"most in use {_mib(c['high_water_bytes'])}"
    )


def first_step_line(m: dict[str, Any]) -> str:
    line = f"first step's fresh CPU memory: {m['recorded_blocks']:,} blocks, {_mib(m['recorded_bytes'])}"
    if "primed_blocks" in m:
        source = (
            "the last run's record" if m.get("primed_from") == "record" else "the weights' gradients (no record yet)"
        )
        line += (
            f"; primed from {source}: {m['primed_blocks']:,} blocks faulted in ahead, "
            f"{m['primed_taken']:,} taken, {_mib(m['returned_bytes'])} given back unasked"
        )
    return line


def _machine_lines(m: dict[str, Any]) -> list[str]:
    sim = f", simulated {m['simulated']}" if m.get("simulated") else ""
    yes = {True: "yes", False: "no"}
    L = [
        f"machine: {m['cpu']} ({m['arch']}, {m['isa']}{sim}; aten dispatch {m['torch_isa']})",
        f"  c++ kernels: {m['cpp_kernels']}",
        f"  cpu fp32 GEMM: {m['cpu_fp32_gemm']}",
        f"  native bf16: {yes[m['native_bf16']['ok']]} ({m['native_bf16']['why']})",
        f"  triton: {yes[m['triton']['ok']]} ({m['triton']['why']}); cuda: {yes[m['cuda']['ok']]} ({m['cuda']['why']})",
    ]
    fb = m.get("runtime_fallbacks") or []
    L.append(f"  fused ops that fell back to their reference at run time: {len(fb)}")
    L += [f"    - {f['op']} ({f['implementation']}): {f['reason']}" for f in fb]
    return L


def summary(rep: Any) -> str:
    """Two lines for the end of a run: what the engine ran, and on which machine."""
    # the latest compile of each frame, training and evaluation apart: an evaluation's graphs are compiled after
    # the training graphs of the same frame and must not hide them (they run on aten while training ran Inductor)
    latest = [
        g
        for g in rep.graphs
        if g["frame_compile"]
        == max(
            h["frame_compile"]
            for h in rep.graphs
            if h["frame"] == g["frame"] and bool(h.get("inference")) == bool(g.get("inference"))
        )
    ]

    def providers(graphs: list[dict[str, Any]]) -> str:
        return "/".join(sorted({g["provider"] for g in graphs})) or "-"

    train = [g for g in latest if not g.get("inference")]
    evals = [g for g in latest if g.get("inference")]
    if train and evals:
        ran = f"{len(train)} training graph(s) on {providers(train)}, {len(evals)} evaluation graph(s) on {providers(evals)}"
    else:
        ran = f"{len(latest)} graph(s), provider {providers(latest)}"
    precisions = "/".join(sorted({g["precision"] for g in latest if g["precision"]})) or "-"
    kernel_fb = len((rep.machine or {}).get("runtime_fallbacks") or [])
    eng = (
        f"engine: {ran}, precision {precisions}, graph breaks "
        f"{len(rep.graph_breaks)}, fallbacks {len(rep.fallbacks)}, fused-op fallbacks {kernel_fb}"
        + (" (CAPTURE FAILED: ran eagerly)" if rep.eager_only else "")
    )
    return eng + (
        "\n" + _machine_lines(rep.machine)[0] + "; cpu fp32 GEMM: " + rep.machine["cpu_fp32_gemm"]
        if rep.machine
        else ""
    )


def headline(rep: Any) -> list[str]:
    """The one-screen summary the text opens with: graphs and providers, breaks, fallbacks and why, memory."""
    latest = [
        g
        for g in rep.graphs
        if g["frame_compile"] == max(h["frame_compile"] for h in rep.graphs if h["frame"] == g["frame"])
    ]
    by_provider: dict[str, list[str]] = {}
    for g in latest:
        runs = g.get("calls_per_step", 1)
        key = f"{g['provider'] or '?'} ({g['precision'] or '?'})"
        by_provider.setdefault(key, []).append(g["name"] + (f" (x{runs} per step)" if runs > 1 else ""))
    providers = (
        "; ".join(
            f"{p} for {', '.join(names) if len(names) <= 6 else f'{len(names)} graphs'}"
            for p, names in by_provider.items()
        )
        or "no graph captured yet"
    )
    L = [
        f"summary: {len(rep.graphs)} graph(s) captured"
        + (f", {len(rep.recompiles)} of them recompiles" if rep.recompiles else "")
        + (f"; blocks compiled once: {', '.join(rep.blocks)}" if rep.blocks else ""),
        f"  providers: {providers}",
    ]
    if rep.eager_only:
        L.append("  CAPTURE FAILED: the module runs eagerly")
    L.append(
        f"  graph breaks: {len(rep.graph_breaks)}" + (f" (first: {rep.graph_breaks[0]})" if rep.graph_breaks else "")
    )
    kernel_fb = (rep.machine or {}).get("runtime_fallbacks") or []
    L.append(
        f"  fallbacks: {len(rep.fallbacks)} (engine), {len(kernel_fb)} (fused ops at run time)"
        + (": none" if not rep.fallbacks and not kernel_fb else ", why:")
    )
    why = [f"{part}: {reason}" for part, reason in rep.fallbacks] + [
        f"{f['op']} ({f['implementation']}): {f['reason']}" for f in kernel_fb
    ]
    L += [f"    - {w if len(w) <= 160 else w[:157] + '...'}" for w in why[:4]]
    if len(why) > 4:
        L.append(f"    ... {len(why) - 4} more below")
    step, mem = rep.step_peak, []
    if step is not None:
        mem.append(f"predicted step peak {_mib(step['peak'])} ({step['peak_phase']})")
    if rep.process_peak:
        mem.append(f"predicted process peak {_mib(rep.process_peak['process_peak'])}")
    if rep.measured_peak:
        mem.append(f"measured {rep.measured_peak['what']} {_mib(rep.measured_peak['bytes'])}")
    L.append("  memory: " + ("; ".join(mem) if mem else "no prediction (no training graph yet)"))
    fs = "n/a" if rep.first_step_seconds is None else f"{rep.first_step_seconds:.2f} s"
    L.append(f"  time to first step {fs} (compile {rep.compile_seconds:.2f} s); {rep.calls} accelerated calls")
    return L


def text(rep: Any) -> str:
    """The whole report: the headline, then the details graph by graph and pass by pass."""
    L = [
        f"graphtrain report ({rep.source}; provider={rep.config['provider']}, "
        f"fallback={rep.config['fallback']}, dynamic={rep.config['dynamic']})"
    ]
    L += headline(rep)
    L.append("")
    L.append("details:")
    if rep.eager_only:
        L.append("  CAPTURE FAILED: the module runs eagerly (see fallbacks)")
    fs = "n/a" if rep.first_step_seconds is None else f"{rep.first_step_seconds:.2f} s"
    L.append(f"time to first step: {fs} (compile {rep.compile_seconds:.2f} s); accelerated calls: {rep.calls}")
    p = rep.params
    L.append(
        f"parameters: trained {p['trained']:,} ({_mib(p['trained_bytes'])}), frozen {p['frozen']:,} "
        f"({_mib(p['frozen_bytes'])}), buffers {p['buffers']:,} ({_mib(p['buffer_bytes'])})"
    )
    L.append(f"graphs captured: {len(rep.graphs)}")
    if rep.cache:
        c = rep.cache
        L.append(
            f"  compile cache {c['folder']}: graphtrain pass results {c['passes_hit']} hit, "
            f"{c['passes_miss']} miss; Inductor FX graphs {c['fxgraph_hit']} hit, {c['fxgraph_miss']} miss; "
            f"AOTAutograd {c['aot_hit']} hit, {c['aot_miss']} miss (this process)"
        )
    if rep.blocks:
        runs = sum(g.get("calls_per_step", 1) for g in rep.graphs)
        L.append(
            f"  compiled block by block: {', '.join(rep.blocks)}; {len(rep.graphs)} graphs compiled, "
            f"{runs} graph calls per step"
        )
    L += [f"  note: {n}" for n in rep.notes or []]
    for g in rep.graphs:
        fw = "-" if g["ops_forward"] is None else g["ops_forward"]
        bw = "-" if g["ops_backward"] is None else g["ops_backward"]
        L.append(
            f"  {g['name']}: {g['frame']} compile #{g['frame_compile']} -> {g['provider']}, precision "
            f"{g['precision'] or '?'} ({g['partitioner'] or 'no'} partition), {g['compile_seconds']:.2f} s"
        )
        if g.get("calls_per_step", 1) > 1:
            L.append(f"    compiled once, runs {g['calls_per_step']} times per step (once per block)")
        L.append(
            f"    aten ops: captured {g['ops_captured']} -> after pre-autodiff passes "
            f"{g['ops_pre_autodiff']}; forward {fw}, backward {bw}"
        )
        if g["grads_computed"] is not None:
            n_frozen = sum(k in ("frozen", "buffer") for k in g["input_kinds"])
            work = g["frozen_inputs_with_grad"]
            L.append(
                f"    gradients computed: {g['grads_computed']} of {len(g['input_kinds'])} inputs; "
                f"frozen params/buffers: {n_frozen}, with gradient work: "
                f"{'not counted' if work is None else work}"
            )
        if g["saved_activation_bytes"] is not None:
            L.append(
                f"    saved for backward: {g['saved_tensors']} tensors, {_mib(g['saved_activation_bytes'])}"
                f" (batch {g['batch']})"
            )
        if g.get("recompute"):
            L += _recompute_lines(g["recompute"])
        if g.get("predicted_memory"):
            L += _memory_lines(g["predicted_memory"])
            if rep.process_peak and rep.process_peak["graph"] == g["name"]:
                L += _process_lines(rep.process_peak)
        for note in g["notes"]:
            L.append(f"    note: {note}")
    if rep.process_peak and rep.process_peak["graph"] == "all pieces":
        L.append("step over all graphs (each block's graph once per layer):")
        L += _memory_lines(rep.process_peak["step"]) + _process_lines(rep.process_peak)
    if rep.allocator:
        L.append(allocator_line(rep.allocator))
    if rep.first_step_memory:
        L.append(first_step_line(rep.first_step_memory))
    if rep.saved_activation_bytes_per_sample is not None:
        L.append(
            f"saved activations: {_mib(rep.saved_activation_bytes or 0)} per step, "
            f"{_mib(rep.saved_activation_bytes_per_sample)} per sample"
        )
    L.append(f"graph breaks: {len(rep.graph_breaks)}")
    L += [f"  - {b}" for b in rep.graph_breaks]
    L.append(f"recompiles: {len(rep.recompiles)}")
    L += [f"  - {r['frame']} compile #{r['frame_compile']}, input shapes {r['input_shapes']}" for r in rep.recompiles]
    L.append(f"fallbacks: {len(rep.fallbacks)}")
    L += [f"  - {part}: {why}" for part, why in rep.fallbacks]
    if rep.machine:
        L += _machine_lines(rep.machine)
    L.append("passes (summed over graphs), stage/phase/pass:                rewrites      ms   ops before -> after")
    for r in rep.passes:
        err = f"   FAILED: {r['error']}" if r["error"] else ""
        where = f"{r['stage']:>12}/{r.get('phase') or '-':<13} {r['name']:<34}"
        if r.get("left_to"):
            if r["rewrites"]:
                L.append(
                    f"  {where} {r['rewrites']:>6} {r['seconds'] * 1e3:>8.1f}   "
                    f"found, left to {r['left_to']}'s fused kernels (graph unchanged)"
                )
            continue
        L.append(
            f"  {where} {r['rewrites']:>6} {r['seconds'] * 1e3:>8.1f}   {r['ops_before']:>6} -> {r['ops_after']}{err}"
        )
        L += [f"      {note}" for note in r.get("notes") or []]
    if off := sorted(n for n, on in (rep.config.get("passes") or {}).items() if not on):
        L.append(f"  switched off (engine.passes): {', '.join(off)}")
    if rep.fused_ops:
        L.append("fused ops in the graphs (count; random, recompute, precision, c++):")
        L += [
            f"  {f['name']} x{f['count']}: {'random' if f['random'] else 'deterministic'}, "
            f"{f['recompute']}, {f['precision']}, {'+'.join(f['cpp']) or '-'}"
            for f in rep.fused_ops
        ]
    return "\n".join(L)
