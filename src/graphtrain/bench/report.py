"""Turn a run record into numbers people read: a terminal table, JSON and a markdown report.

`summarize` derives everything from the raw per-round step times the workers measured: median with
min/max and IQR, samples/s and tokens/s, speed ratios (to eager fp32, and to torch.compile at the
same precision; > 1 means faster) with the spread of the per-round ratios, MFU, memory.

`render_docs` builds docs/design/benchmarks.md from the latest run of each suite: every number in its generated
part comes from `markdown(run)`; the prose says how they are made and how to reproduce them, here or on a
CUDA GPU. Sections written by hand (dated runs on other machines) sit between `keep` markers and are carried
over to the end of the regenerated page.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from graphtrain.bench.suites import REFERENCE, SUITES, VARIANTS
from graphtrain.kernels import flops
from graphtrain.runs.plot import write_bar_page

FLOP_FORMULA = "(6 * N + 12 * n_layer * seq * d_model) * batch * seq"


def quartiles(xs: list[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def _ratios(ref: list[float], mine: list[float]) -> tuple[float, float, float]:
    """(ratio of medians, min, max of per-round ratios): ref time / my time, rounds paired by index."""
    n = min(len(ref), len(mine))
    per_round = [r / m for r, m in zip(ref[:n], mine[:n])]
    return statistics.median(ref) / statistics.median(mine), min(per_round), max(per_round)


def summarize(run: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (case, variant), with all derived figures."""
    peak = run.get("peak") or {}
    rows = []
    for case in run["cases"]:
        c = case["case"]
        recs = case["variants"]
        for name, rec in recs.items():
            row: dict[str, Any] = {
                "case": case["name"],
                "variant": name,
                "status": rec.get("status", "error"),
                "reason": rec.get("reason", ""),
            }
            times = rec.get("step_s") or []
            if row["status"] == "ok" and times:
                med = statistics.median(times)
                q1, q3 = quartiles(times)
                setup = rec.get("setup", {})
                prec = _precision(name)
                row.update(
                    median_s=med,
                    min_s=min(times),
                    max_s=max(times),
                    q1_s=q1,
                    q3_s=q3,
                    rounds=len(times),
                    samples_s=c["batch"] / med,
                    tokens_s=c["batch"] * c["seq"] / med,
                    # MFU on the FLOPs the variant runs; the dense formula's figure beside it when they differ
                    mfu=flops.mfu(
                        setup.get("executed_flops_per_step", setup.get("flops_per_step", 0)),
                        med,
                        flops.mfu_peak(peak, prec),
                    ),
                    mfu_dense=flops.mfu(setup.get("flops_per_step", 0), med, flops.mfu_peak(peak, prec))
                    if setup.get("flops_shortcut")
                    else None,
                    shortcut=setup.get("flops_shortcut"),
                    flops_per_step=setup.get("flops_per_step"),
                    ttfs_s=setup.get("time_to_first_step_s"),
                    full_speed_s=setup.get("time_to_full_speed_s"),
                    children_peak_mem_mib=rec.get("children_peak_mem_mib"),
                    peak_mem_mib=rec.get("peak_mem_mib"),
                    step_peak_mem_mib=rec.get("step_peak_mem_mib"),
                    final_loss=rec.get("final_loss"),
                    steps_done=rec.get("steps_done"),
                    opt_ms=statistics.median(rec["opt_s"]) * 1e3 if rec.get("opt_s") else None,
                    optimizer=setup.get("optimizer"),
                    gemm_floor=rec.get("gemm_floor"),
                )
                for key, ref_name in (
                    ("vs_eager", REFERENCE),
                    ("vs_compile", f"compile-{prec}"),
                    ("vs_best", _best_baseline(recs, prec)),
                ):
                    ref = recs.get(ref_name, {}) if ref_name else {}
                    if ref.get("status") == "ok" and ref.get("step_s"):
                        row[key], row[key + "_min"], row[key + "_max"] = _ratios(ref["step_s"], times)
                        if key == "vs_best":
                            row["best_baseline"] = ref_name
                ab = VARIANTS[name].ablates if name in VARIANTS else None
                base = recs.get(f"graphtrain-{prec}", {})  # the same precision with every lever on
                if ab and base.get("status") == "ok" and base.get("step_s"):
                    # < 1: graphtrain is that much slower without the lever
                    row["ablates"] = ab
                    row["vs_graphtrain"], row["vs_graphtrain_min"], row["vs_graphtrain_max"] = _ratios(
                        base["step_s"], times
                    )
            if rec.get("maxbatch"):
                row["maxbatch"] = rec["maxbatch"]
            rows.append(row)
    return rows


BASELINE_MODES = ("eager", "compile")


def _best_baseline(recs: dict[str, Any], prec: str) -> str | None:
    """The fastest baseline variant (eager or torch.compile in any mode, fused AdamW) of this precision that ran:
    'vs best baseline' compares with it."""
    best, best_t = None, float("inf")
    for name, rec in recs.items():
        v = VARIANTS.get(name)
        if (
            v is None
            or v.mode not in BASELINE_MODES
            or v.precision != prec
            or v.optimizer != "fused"
            or rec.get("status") != "ok"
            or not rec.get("step_s")
        ):
            continue
        t = statistics.median(rec["step_s"])
        if t < best_t:
            best, best_t = name, t
    return best


# ---------------------------------------------------------------------------- formatting ----


def _f(x: Any, fmt: str, dash: str = "-") -> str:
    return dash if x is None else format(x, fmt)


def ratio_bound(x: float) -> str:
    """One end of a ratio's range, to 2 decimals unless that would hide which side of 1.00x it lies on: then to 3,
    rounded away from 1.00 (0.9991 prints 0.999, 1.0004 prints 1.001), so a range that straddles 1.00x always shows
    it (an AVX2 run printed Llama's 0.999-1.071 against max-autotune as 1.00-1.07)."""
    text = f"{x:.2f}"
    if (x < 1.0) == (float(text) < 1.0) and (x > 1.0) == (float(text) > 1.0):
        return text
    return f"{(math.floor if x < 1.0 else math.ceil)(x * 1000) / 1000:.3f}"


def ratio_range(lo: float, hi: float) -> str:
    """The range as "lo-hi", each end by `ratio_bound`."""
    return f"{ratio_bound(lo)}-{ratio_bound(hi)}"


def _ratio(row: dict[str, Any], key: str) -> str:
    if key not in row:
        return "-"
    return f"{row[key]:.2f}x ({ratio_range(row[key + '_min'], row[key + '_max'])})"


def _maxbatch(row: dict[str, Any]) -> str:
    mb = row.get("maxbatch")
    if not mb:
        return "-"
    if mb.get("max_batch") is None:
        return "none" if mb.get("exact") else "?"
    return f"{mb['max_batch']}{'' if mb.get('exact') else '+'} @ {mb['cap_gib']:g} GiB"


COLUMNS = (
    "variant",
    "ms/step median (min-max)",
    "IQR ms",
    "samples/s",
    "tokens/s",
    "vs eager fp32",
    "vs compile same prec",
    "vs best baseline same prec",
    "MFU",
    "optimizer ms",
    "peak MiB (steps)",
    "1st step / full speed s",
    "loss@N",
    "max batch",
)


def row_cells(row: dict[str, Any]) -> list[str]:
    if row["status"] != "ok" or "median_s" not in row:  # the reason is printed under the table
        return [row["variant"], row["status"] if row["status"] != "ok" else "no timings"] + [""] * (len(COLUMNS) - 2)
    ms = f"{row['median_s'] * 1e3:.1f} ({row['min_s'] * 1e3:.1f}-{row['max_s'] * 1e3:.1f})"
    mem = f"{_f(row['peak_mem_mib'], '.0f')} ({_f(row.get('step_peak_mem_mib'), '.0f')})"
    if (row.get("children_peak_mem_mib") or 0) >= 1:  # a compile process beside the worker (see the footnote)
        mem += f" +{row['children_peak_mem_mib']:.0f} child"
    loss = f"{row['final_loss']:.4f}@{row['steps_done']}" if row.get("final_loss") is not None else "-"
    mfu = _pct(row.get("mfu"))
    if row.get("mfu_dense") is not None:
        mfu += f" (dense-equivalent {_pct(row['mfu_dense'])})"
    mark = SHORTCUT_MARK if row.get("shortcut") else ""  # a shortcut eager does not get: named under the table
    return [
        row["variant"],
        ms,
        f"{(row['q3_s'] - row['q1_s']) * 1e3:.1f}",
        f"{row['samples_s']:.1f}",
        f"{row['tokens_s']:.0f}",
        _ratio(row, "vs_eager") + mark,
        _ratio(row, "vs_compile") + mark,
        _ratio(row, "vs_best") + mark + (f" {row['best_baseline']}" if row.get("best_baseline") else ""),
        mfu,
        _f(row.get("opt_ms"), ".1f") + (f" {row['optimizer']}" if row.get("optimizer") else ""),
        mem,
        f"{_f(row.get('ttfs_s'), '.1f')} / {_f(row.get('full_speed_s'), '.1f')}",
        loss,
        _maxbatch(row),
    ]


SHORTCUT_MARK = " +"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.{1 if x >= 0.01 else 2}f}%"


def notes(rows: list[dict[str, Any]], case: str) -> list[str]:
    """Why variants did not run, the shortcuts behind marked ratios, and max-batch search remarks, for one case."""
    out = [f"{r['variant']} {r['status']}: {r['reason']}" for r in rows if r["case"] == case and r["status"] != "ok"]
    out += [
        f"{r['variant']}:{SHORTCUT_MARK} marks ratios that include a shortcut eager does not get ({r['shortcut']}); "
        f"its MFU counts the FLOPs that run, the dense-equivalent one those of the dense formula"
        + ("; the graphtrain-fp32-no-sparse-head ablation measures the shortcut" if "sparse" in r["shortcut"] else "")
        for r in rows
        if r["case"] == case and r.get("shortcut")
    ]
    out += [
        f"{r['variant']} max batch: {r['maxbatch']['note']}"
        for r in rows
        if r["case"] == case and r.get("maxbatch", {}).get("note")
    ]
    return out


def terminal_table(run: dict[str, Any]) -> str:
    rows = summarize(run)
    out = []
    for case in dict.fromkeys(r["case"] for r in rows):
        cells = [list(COLUMNS)] + [row_cells(r) for r in rows if r["case"] == case]
        widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
        out.append(f"== {case}")
        for i, c in enumerate(cells):
            out.append("  ".join(x.ljust(w) for x, w in zip(c, widths)).rstrip())
            if i == 0:
                out.append("  ".join("-" * w for w in widths))
        out += [f"  note: {n}" for n in notes(rows, case)]
        out.append("")
    return "\n".join(out)


def _idle_read(env: dict[str, Any]) -> str:
    """The machine line's note of the idle-read probe (runner.idle_read_penalty), where the run recorded it."""
    start, end = env.get("idle_read_start"), env.get("idle_read_end")
    if not start:
        return ""
    return (
        f"; memory left alone {start['idle_s']:g} s read {start['ratio']:.1f}x slower than memory just read at start"
        + (f", {end['ratio']:.1f}x at end" if end else "")
        + " (1.0x: no slow period; docs/design/benchmarks.md)"
    )


def _huge_pages(run: dict[str, Any]) -> str:
    """The protocol's sentence on huge pages: per case, what graphtrain chose for its model and every variant got
    (bench/case.py Worker.setup); a record without that per-case fact had them on in every process."""
    if not run.get("settings", {}).get("huge_pages"):
        return ""
    by_case: dict[bool, list[str]] = {True: [], False: []}
    for c in run.get("cases", []):
        got = {v.get("setup", {}).get("huge_pages") for v in c.get("variants", {}).values()} - {None}
        if len(got) == 1:
            by_case[got.pop()].append(c["name"])
    if not by_case[True] and not by_case[False]:
        return (
            " Every variant's process put CPU blocks of 2 MiB and more on transparent huge pages "
            "(engine.cpu_huge_pages), whatever graphtrain would choose for the model."
        )
    said = "; ".join(f"{'on' if k else 'off'} for {', '.join(names)}" for k, names in by_case.items() if names)
    return (
        " Huge pages (CPU blocks of 2 MiB and more on transparent huge pages) as graphtrain chooses them for each "
        f"case's model (engine.cpu_huge_pages auto), in every variant's process: {said}."
    )


def markdown(run: dict[str, Any], heading: str = "##") -> str:
    env, peak, s = run.get("env", {}), run.get("peak") or {}, run.get("settings", {})
    lines = [
        f"{heading} Suite `{run['suite']}` ({run.get('started', '?')})",
        "",
        f"Command: `{run.get('command', '?')}`",
        "",
        *(
            [f"**Partial run**: interrupted after {len(run['cases'])} case(s); only those are shown.", ""]
            if "finished" not in run
            else []
        ),
        f"Machine: {env.get('cpu', '?')}"
        + (f" ({env['cpu_family_model']})" if env.get("cpu_family_model") else "")
        + (f", **simulated {env['simulated']}**" if env.get("simulated") else "")
        + (f" (environment: {', '.join(f'{k}={v}' for k, v in env['isa_env'].items())})" if env.get("isa_env") else "")
        + f", {env.get('cores', '?')} cores"
        + (f", GPU {env['gpu']}" if env.get("gpu") else "")
        + (f", CPU capability {env['isa']} (aten dispatch {env.get('torch_isa')})" if env.get("isa") else "")
        + f", flags: {', '.join(env.get('cpu_flags', [])) or 'no avx2/avx512/amx'}; "
        f"{s.get('threads', env.get('cores', '?'))} torch threads, device `{env.get('device', 'cpu')}`"
        + (
            f"; load average {env['loadavg_start'][0]:.1f} at start, "
            f"{(env.get('loadavg_end') or ['?'])[0]} at end (other work on the machine adds noise)"
            if env.get("loadavg_start")
            else ""
        )
        + _idle_read(env)
        + ".",
        "",
        f"Versions: python {env.get('python')}, torch {env.get('torch')}, graphtrain {env.get('graphtrain')}"
        + (f", transformers {env['transformers']}" if env.get("transformers") else "")
        + f", git `{(env.get('git_sha') or '?')[:12]}`{' (uncommitted changes)' if env.get('git_dirty') else ''}.",
        "",
        f"Protocol: {s.get('warmup')} warmup steps after the first, then {s.get('repeats')} "
        + ("rounds of " if s.get("max_workers") == 1 else "interleaved rounds of ")
        + f"{s.get('steps')} steps per variant "
        + (
            "(one variant's process at a time, each alone on the machine)"
            if s.get("max_workers") == 1
            else "(order rotated each round)"
        )
        + "; ratios are ref time / time (> 1 is faster), the range in brackets is the spread of the "
        "per-round ratios. Every variant uses fused AdamW (eager and torch.compile: torch.optim.AdamW(fused=True)) "
        "unless its name says loop-adamw; glibc's mmap threshold is "
        + (
            "pinned in every variant's process (a recompute variant ran, and graphtrain pins it for recompute). "
            "Pinned, glibc returns every freed large block to the OS and the next step faults its pages in "
            "again, so every variant's step is slower than in an unpinned table (measured 1.50x on eager "
            "gpt2-small, 2-core AVX2 EPYC): compare ratios within this table, not step times across tables"
            if s.get("pin_mmap")
            else "kept in every variant's process: glibc serves freed blocks up to 1 GiB from its heap for the next "
            "step, what graphtrain sets without recompute (engine.cpu_allocator)"
            if s.get("allocator") == "keep"
            else "left at glibc's default in every process"
        )
        + "."
        + _huge_pages(run),
        "",
        f"MFU = model FLOPs / step time / measured matmul peak: fp32 {_f(peak.get('fp32'), '.3g')} FLOP/s"
        + (
            f" (the better of aten/MKL {_f(peak.get('fp32_aten'), '.3g')} and oneDNN "
            f"{_f(peak.get('fp32_onednn'), '.3g')})"
            if peak.get("fp32_onednn")
            else ""
        )
        + f", bf16 {_f(peak.get('bf16'), '.3g')} FLOP/s (`{peak.get('command', flops.PEAK_COMMAND)}`); "
        f"FLOPs per step = `{FLOP_FORMULA}`, N = parameters minus position/token-type embeddings."
        + (
            f" bf16 MFU on this GPU is against the {peak.get('device_name')}'s datasheet dense bf16 peak, "
            f"{_f(peak['bf16_datasheet'], '.4g')} FLOP/s, not the measured one."
            if peak.get("bf16_datasheet")
            else ""
        ),
        "",
    ]
    rows = summarize(run)
    for case in run["cases"]:
        setup = next((v.get("setup") for v in case["variants"].values() if v.get("setup")), {}) or {}
        lines += [f"{heading}# {case['name']}", ""]
        if setup:
            lines += [
                f"{setup.get('params', 0) / 1e6:.1f} M parameters (N = {setup.get('matmul_params', 0) / 1e6:.1f} M), "
                f"{setup.get('n_layer')} layers, d_model {setup.get('d_model')}, "
                f"{_f(setup.get('flops_per_step'), '.3g')} FLOP per step.",
                "",
            ]
        lines += roofline(rows, case["name"], peak)
        lines += ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        lines += ["| " + " | ".join(row_cells(r)) + " |" for r in rows if r["case"] == case["name"]]
        lines.append("")
        lines += [f"* {n}" for n in notes(rows, case["name"])]
        lines += [""] if notes(rows, case["name"]) else []
        lines += ablation_table(rows, case["name"])
    lines += [
        "Peak MiB: the worker process's peak RSS (VmHWM; CUDA: max allocated), including compile; in brackets "
        "the peak during the timed steps only; `+N child`: the largest peak of a process it started (the "
        "background Inductor compile, compile workers), so the whole job peaked at no more than the sum. "
        "1st step / full speed: seconds from building the model to the end of the first step, and to the end "
        "of the first step at the speed the variant keeps (graphtrain's first steps run on aten while Inductor "
        "compiles in the background; for the other variants the two are the same). Max batch: largest measured batch whose peak stays under the cap "
        "(`+`: a measured lower bound, the search ran out of trials).",
        "",
    ]
    return "\n".join(lines)


def roofline(rows: list[dict[str, Any]], case: str, peak: dict[str, Any]) -> list[str]:
    """How much faster than eager any variant of the same precision could be: the step's FLOPs at the measured GEMM
    peak against eager's step (1 / eager's MFU). A ratio such as 1.05x reads differently against a ceiling of 1.3x
    than of 3x. With `--gemm-floor`, the sharper bound too: eager's matmuls, each timed alone (gemm_floor_lines)."""
    lines = []
    for prec in ("fp32", "bf16"):
        ref = next((r for r in rows if r["case"] == case and r["variant"] == f"eager-{prec}" and r.get("mfu")), None)
        if ref is None or not peak.get(prec) or not ref.get("flops_per_step"):
            continue
        ideal_ms = ref["flops_per_step"] / peak[prec] * 1e3
        lines += [
            f"Roofline ({prec}): this step's FLOPs at the measured {prec} GEMM peak take {ideal_ms:.1f} ms; "
            f"eager {prec} runs at {100 * ref['mfu']:.1f}% of that rate, so no {prec} variant can beat it by "
            f"more than {1 / ref['mfu']:.2f}x here.",
            "",
        ]
        lines += gemm_floor_lines(rows, case, prec, ref, peak[prec])
    return lines


def _layout(shape: list[int], stride: list[int]) -> str:
    """N or T for a matrix operand (the last two dims): T when its rows are the contiguous dimension."""
    if len(shape) < 2 or len(stride) < 2:
        return ""
    return "T" if stride[-2] == 1 and shape[-1] > 1 and stride[-1] != 1 else "N"


def gemm_floor_lines(
    rows: list[dict[str, Any]], case: str, prec: str, ref: dict[str, Any], peak_flops: float
) -> list[str]:
    """The GEMM floor (bench/gemm_floor.py) of eager's step: a sentence, and the matmuls that weigh most."""
    floor = ref.get("gemm_floor")
    if not floor or not floor.get("floor_ms") or not floor.get("matmul_ms"):
        return []
    f_ms, mm_ms, eager_ms = floor["floor_ms"], floor["matmul_ms"], ref["median_s"] * 1e3
    rate = floor["matmul_flops"] / mm_ms / 1e6
    attn = (
        f", plus {floor['attention_flops'] / 1e9:.2f} GFLOP of fused attention counted at the peak "
        f"({floor['attention_ms_at_peak']:.1f} ms)"
        if floor.get("attention_flops")
        else ""
    )
    best_mfu = ref["flops_per_step"] / (f_ms / 1e3) / peak_flops
    text = (
        f"GEMM floor ({prec}): eager's {floor['matmul_calls']} matmuls ({floor['matmul_flops'] / 1e9:.2f} GFLOP), "
        f"each timed alone at its own shape and layout, take {mm_ms:.1f} ms ({rate:.0f} GFLOP/s, "
        f"{100 * rate * 1e9 / peak_flops:.0f}% of the peak){attn}: a floor of {f_ms:.1f} ms. A variant that runs the "
        f"same matmuls cannot beat eager's {eager_ms:.1f} ms by more than {eager_ms / f_ms:.2f}x, nor reach more "
        f"than {100 * best_mfu:.0f}% MFU here."
    )
    mine = next(
        (r for r in rows if r["case"] == case and r["variant"] == f"graphtrain-{prec}" and r.get("median_s")), None
    )
    if mine is not None:
        text += f" graphtrain {prec}: {mine['median_s'] * 1e3:.1f} ms, {mine['median_s'] * 1e3 / f_ms:.2f}x the floor"
        text += " (it runs fewer matmuls: the sparse head)." if mine.get("shortcut") else "."
    lines = [
        text,
        "",
        "| matmul | operands (layout) | dtype | calls | ms each | GFLOP/s | library |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in floor.get("top", [])[:5]:
        ops = " x ".join(
            f"{list(sh)}{_layout(sh, st)}" for sh, st in zip(t["shapes"][-2:], t["strides"][-2:], strict=True)
        )
        lines.append(
            f"| {t['op']} | {ops} | {t['dtype']} | {t['count']} | {t['ms_each']:.2f} | {t['gflops_s']:.0f} | "
            f"{t['library']} |"
        )
    return lines + [""]


def ablation_table(rows: list[dict[str, Any]], case: str) -> list[str]:
    """Where the speed comes from: graphtrain with one lever switched off at a time, against graphtrain in the same
    precision with every lever on (empty without ablations)."""
    lines: list[str] = []
    for prec in ("fp32", "bf16"):
        abl = [r for r in rows if r["case"] == case and r.get("ablates") and _precision(r["variant"]) == prec]
        base = next(
            (r for r in rows if r["case"] == case and r["variant"] == f"graphtrain-{prec}" and "median_s" in r), None
        )
        if not abl or base is None:
            continue
        lines += [
            f"Ablation (graphtrain {prec}, one lever off at a time; speed relative to graphtrain with every lever on, "
            "< 1 = slower without it):",
            "",
            "| lever switched off | variant | ms/step | vs graphtrain (all on) | vs eager fp32 | vs best baseline | "
            "peak MiB |",
            "|---|---|---|---|---|---|---|",
            f"| (none) | graphtrain-{prec} | {base['median_s'] * 1e3:.1f} | 1.00x | {_ratio(base, 'vs_eager')} | "
            f"{_ratio(base, 'vs_best')} | {_f(base.get('peak_mem_mib'), '.0f')} |",
        ]
        for r in abl:
            if "median_s" not in r:
                continue
            lines.append(
                f"| {r['ablates']} | {r['variant']} | {r['median_s'] * 1e3:.1f} | {_ratio(r, 'vs_graphtrain')} | "
                f"{_ratio(r, 'vs_eager')} | {_ratio(r, 'vs_best')} | {_f(r.get('peak_mem_mib'), '.0f')} |"
            )
        lines.append("")
    return lines


def _precision(variant: str) -> str:
    return VARIANTS[variant].precision if variant in VARIANTS else "fp32"


def _stem(run: dict[str, Any]) -> str:
    return f"{run['suite']}-{run.get('started', 'run').replace(':', '').replace('-', '')[:15]}"


def save_partial(run: dict[str, Any], out_dir: Path) -> Path:
    """Checkpoint an unfinished run (cases done so far); `save` removes it when the run completes."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{_stem(run)}.partial.json"
    path.write_text(json.dumps(run, indent=1) + "\n")
    return path


def save(run: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    """Write <suite>-<stamp>.json and .md, refresh <suite>-latest.md, append to results.jsonl."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = _stem(run)
    paths = {
        "json": out_dir / f"{stem}.json",
        "md": out_dir / f"{stem}.md",
        "latest": out_dir / f"{run['suite']}-latest.md",
        "jsonl": out_dir / "results.jsonl",
        "html": out_dir / f"{stem}.html",
        "latest_html": out_dir / f"{run['suite']}-latest.html",
    }
    (out_dir / f"{stem}.partial.json").unlink(missing_ok=True)
    paths["json"].write_text(json.dumps(run, indent=1) + "\n")
    text = markdown(run)
    paths["md"].write_text(text)
    paths["latest"].write_text(text)
    with open(paths["jsonl"], "a") as f:
        f.write(json.dumps(run) + "\n")
    html_page(run, paths["html"])
    paths["latest_html"].write_text(paths["html"].read_text())
    return paths


def html_page(run: dict[str, Any], out: Path) -> Path:
    """The run as an HTML page (runs/plot.py): per case, each variant's speed against eager as a bar with its
    spread over the interleaved repeats, then the markdown tables' figures as a table."""
    groups: dict[str, list[tuple[str, float, float, float]]] = {}
    for row in summarize(run):
        if row.get("vs_eager") is not None:
            groups.setdefault(row["case"], []).append(
                (row["variant"], row["vs_eager"], row["vs_eager_min"], row["vs_eager_max"])
            )
    env = run.get("env", {})
    intro = (
        f"`{run.get('command', 'graphtrain bench ' + run['suite'])}` on {env.get('cpu', '?')} "
        f"({env.get('cores', '?')} cores), torch {env.get('torch', '?')}, graphtrain {env.get('graphtrain', '?')}"
        f" ({env.get('git_sha', '?')}), {run.get('started', '')}"
    )
    table = "<pre>" + terminal_table(run).replace("&", "&amp;").replace("<", "&lt;") + "</pre>"
    return write_bar_page(f"graphtrain bench {run['suite']}", groups, out, intro, table)


def latest_runs(out_dir: Path, include_partial: bool = False) -> dict[str, dict[str, Any]]:
    """The last complete run of each suite in <out>/results.jsonl (optionally: or a newer partial one)."""
    runs: dict[str, dict[str, Any]] = {}
    path = out_dir / "results.jsonl"
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                run = json.loads(line)
                runs[run["suite"]] = run
    if include_partial:  # an interrupted run newer than the last complete one of its suite
        for p in sorted(out_dir.glob("*.partial.json")):
            run = json.loads(p.read_text())
            if run.get("cases") and run.get("started", "") > runs.get(run["suite"], {}).get("started", ""):
                runs[run["suite"]] = run
    return runs


# ------------------------------------------------------------------ docs/design/benchmarks.md ----

SUITE_ORDER = ("small", "hf", "hf-wide", "gpu", "ablation", "seed", "seed-ablation", "tiny")

INTRO = """# Benchmarks

`graphtrain bench SUITE` times one training step (forward, loss, backward, AdamW step, zero_grad)
of the same model, batch and seed under several execution variants in one run, and reports speed,
memory and convergence side by side. This page is generated by `graphtrain bench --docs
docs/design/benchmarks.md` from the latest run of each suite in `bench_results/results.jsonl`; the
machine, the versions and the exact command are printed above each table.

## How to run

```bash
graphtrain bench --list                        # suites, cases, variants
graphtrain bench small                         # all variants; 4 compiled variants x 4 models to compile first
graphtrain bench hf                            # Hugging Face models graphtrain did not write
graphtrain bench seed --cap-gib 12             # BERT-Large / GPT-2 Medium + largest batch under 12 GiB
graphtrain bench small --cases gpt2-small --variants eager-fp32 graphtrain-fp32 --repeats 7
graphtrain bench hf --gemm-floor                # also time each matmul of eager's step alone: a floor per case
graphtrain bench small --docs docs/design/benchmarks.md   # run, then regenerate this page
```

Results go to `--out` (default `bench_results/`, git-ignored): `<suite>-<time>.json` (raw
per-round step times, memory, losses, versions, git sha, CPU model), the same as markdown, and one
line per run appended to `results.jsonl`. Each worker's stderr is kept under `logs/`.

## On a CUDA GPU

```bash
pip install -e '.[dev]'                        # with a CUDA build of torch already installed
graphtrain bench gpu                           # issue #48's comparison, on cuda:0 by default
graphtrain bench gpu --maxbatch                # also the largest batch under --cap-gib (default 40)
graphtrain bench seed --device cuda --cap-gib 30   # e.g. a 32 GB V100/A100: the blog's setting
PYTHONPATH=src bash scripts/gpu-check.sh bench # from a source checkout with nothing installed
```

Suite `gpu` is Hugging Face GPT-2 124M (batch 16, seq 512), a 155M Llama with grouped-query attention
(batch 8, seq 1024) and BERT-base MLM (batch 32, seq 512), built from config, in bf16: eager and
torch.compile (default and `max-autotune`) under autocast against `graphtrain.accelerate(precision="bf16")`,
every variant with fused AdamW and `torch.set_float32_matmul_precision("high")` (TF32 allowed).
With `--device cuda` (suite `gpu`'s default) the model and batch live on `cuda:0`, each timed block
ends with `torch.cuda.synchronize()`, autocast uses `device_type="cuda"`, memory is
`torch.cuda.max_memory_allocated()` (the largest-batch search compares that with the cap), and bf16
MFU is against the GPU's datasheet dense bf16 peak where `graphtrain.kernels.flops.DATASHEET_BF16`
knows the GPU (989 TFLOP/s for an H100 SXM or H200), else against a bf16 matmul measured on it. The
CPU-sized batches of the `seed` suite are small for a GPU: raise them with a larger cap and read the
max-batch column, which is what the ORT blog compared (batch 64 vs 128 for BERT-Large phase 1 on a
32 GB V100).

## Method

* **One setup factory** (`graphtrain/bench/case.py`): the model is built from seed 1337, the batch
  is random token ids from a seeded generator (BERT: MLM labels on 15% of positions), AdamW
  (lr 1e-3, betas 0.9/0.95, weight decay 0.01 on matrices) is the same for every variant, and all
  torch threads are used (`torch.set_num_threads(os.cpu_count())`).
* **Interleaving.** Each (case, variant) runs in its own long-lived process. All variants of a case
  are set up one after another (so time to first step, which includes compiling, is measured on an
  idle machine), warmed up, then timed in rounds: every round asks each process for one block of
  steps, and the order rotates (A B C, B C A, ...). The table gives the median step time over
  rounds with min-max and IQR; each ratio comes with the min-max of its per-round ratios. Timings
  on this kind of machine vary by up to a third run to run, so a ratio whose range straddles 1.0
  is not a result. The `seed` suite is the exception: a GPT-2 Medium worker at seq 1024 holds
  about 12 GB, so its variants run one at a time (`max_workers=1`), each alone on the machine.
* **Memory** is the peak resident set (VmHWM) of the variant's process, including imports (about
  250-400 MiB for torch, more with transformers) and compile-time transients; the value in brackets
  is the peak during the timed steps only (the kernel's high-water mark is reset before round 1).
* **Loss@N** is the loss after N steps from the same seed on one fixed batch: a sanity check (finite,
  falling), not a parity check. Memorizing one batch at lr 1e-3 is unstable at the seed models' size,
  and each variant is one sample of dropout noise: eager and torch.compile draw different random
  streams, while all graphtrain variants of a case draw the *same* one (the same seeds from the same
  generator), so four graphtrain rows that agree are one sample, not four. Measured on GPT-2 Medium at
  seq 1024, batch 1, dropout 0.1, AdamW lr 1e-3 (tests' parity script, 2-core AVX2 EPYC, 2026-11-23),
  the loss after 4 steps over three dropout seeds was 8.10, 8.49 and 14.10 for eager PyTorch and 8.19,
  13.14 and 7.92 for `graphtrain.accelerate(provider="aten")`: both spike on one seed of three. With
  dropout 0 graphtrain matched eager to 4 decimals at every step (11.0099, 10.3821, 8.9386, 9.1221/9.1222,
  7.4294). Parity is what the test suite checks, forward and backward, per pass and per model, and at
  the seed depth and sequence length (`tests/test_seed_scale_parity.py`, slow): loss curves at a stable
  learning rate with dropout 0 within the fp32 tolerance, and with dropout 0.1 within eager's spread over
  three seeds.
* **Largest batch under a cap** (`maxbatch.py`): a fresh process per trial batch measures its
  whole-process peak; a line fitted through the measurements nearest the cap predicts the largest
  batch, which is then confirmed or bisected by measurement. No RLIMIT_AS (it limits virtual
  memory, which torch reserves far beyond what it touches) and no cgroup (root-only and not
  portable); a trial predicted to exceed the free memory is never started.
"""


def _variants_table() -> str:
    lines = ["| variant | what runs |", "|---|---|"]
    lines += [f"| `{v.name}` | {v.doc} |" for v in VARIANTS.values()]
    return "\n".join(lines)


def _mfu_text(runs: dict[str, dict[str, Any]]) -> str:
    peak = next((r.get("peak") for r in runs.values() if r.get("peak") and "fp32" in r["peak"]), None)
    measured = (
        ""
        if peak is None
        else f" On this machine the peak measured with `{peak.get('command', flops.PEAK_COMMAND)}` "
        f"({peak.get('threads')} threads) was {peak['fp32'] / 1e9:.0f} GFLOP/s fp32"
        + (
            f" (aten's MKL path {peak['fp32_aten'] / 1e9:.0f}, oneDNN {peak['fp32_onednn'] / 1e9:.0f}: the fp32 "
            "peak is the better of the two)"
            if peak.get("fp32_onednn")
            else ""
        )
        + " and "
        f"{peak['bf16'] / 1e9:.0f} GFLOP/s bf16 (best of {peak.get('repeats')} timed n x n matmuls, "
        f"n in {peak.get('sizes_run') or peak.get('sizes')}: sizes grow while they fit a time budget); "
        "it is measured once per machine and cached, and each run prints it above its tables."
    )
    return (
        "## MFU\n\nFLOPs per step = `" + FLOP_FORMULA + "`, with N the trainable parameters except "
        "position and token-type embeddings (a tied token embedding counts once, as the LM head's matmul): "
        "6 N per token for the forward and backward matmuls, plus 12 n_layer seq d_model per token for "
        "attention's two matmuls (the causal mask is not subtracted). Softmax, norms, GELU and the optimizer "
        "are not counted. MFU = FLOPs per step / step time / the measured matmul peak of the variant's "
        "precision (bf16 variants against the bf16 peak). MFU counts the FLOPs a variant runs: graphtrain computes "
        "a masked-LM head only on the rows that carry a label (the sparse head), so its FLOPs per step are the "
        "formula's less 6 x (vocab x d_model) per skipped row; the dense formula's figure is printed beside it, "
        "labelled dense-equivalent, and every ratio that includes the shortcut is marked." + measured + "\n"
    )


KEEP_BEGIN = "<!-- keep: written by hand; `graphtrain bench --docs` carries it over -->"
KEEP_END = "<!-- /keep -->"


def kept_sections(page: str) -> list[str]:
    """The hand-written sections of an existing page (each between KEEP_BEGIN and KEEP_END, markers included):
    dated runs of other machines or of a subset of a suite, which the latest run of each suite does not replace."""
    import re

    return re.findall(re.escape(KEEP_BEGIN) + r".*?" + re.escape(KEEP_END), page, flags=re.DOTALL)


def render_docs(runs: dict[str, dict[str, Any]], kept: list[str] = ()) -> str:
    """The page from the latest run of each suite, followed by the `kept` hand-written sections (kept_sections)."""
    parts = [INTRO, "## Variants\n", _variants_table(), "", _mfu_text(runs), "## Results\n"]
    for name in SUITE_ORDER:
        if name in runs:
            parts.append(f"{SUITES[name].doc[0].upper()}{SUITES[name].doc[1:]}.\n" if name in SUITES else "")
            parts.append(markdown(runs[name], heading="###"))
    parts.extend(f"{section}\n" for section in kept)
    missing = [s for s in ("small", "hf", "ablation", "seed") if s not in runs]
    if missing:
        parts.append(
            "Not yet recorded here: "
            + ", ".join(f"`{s}`" for s in missing)
            + " (run `graphtrain bench SUITE --docs docs/design/benchmarks.md`).\n"
        )
    return "\n".join(parts)
