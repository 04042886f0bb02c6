"""``graphtrain.bisect``: find the first optimization that takes training away from eager PyTorch.

    rep = graphtrain.bisect(lambda: MyModel(), batch, steps=3)    # batch: kwargs dict, args tuple or tensor
    print(rep)          # every configuration with its largest error; the culprit, its tensor and error
    graphtrain bisect configs/x.yaml --provider inductor            # the same on a configured job

Eager PyTorch is the reference. Each configuration trains a fresh model (eager's starting weights) `steps` SGD
steps on one batch, and the loss and every parameter gradient are compared with eager's at every step under
`graphtrain.testing.TOLERANCES`. In pipeline order: (1) the engine with every pass off; (2) each pass added to
the ones before it, fused ops forced to their reference implementation (`kernels._common.force_reference`) so a
fusion is judged on its rewrite alone (a pass that rewrote nothing in the full pipeline is listed, not run);
(3) each fused op's fast implementations (forward and backward, then the forward alone when they fail);
(4) the provider, when it is not aten. (1)-(3) run under the aten provider, op by op, so a difference there is
the pass's or the kernel's own. The first configuration out of tolerance is the culprit; it is switched off
again for the rows after it, which are then judged on their own change. The choices: SGD (Adam's normalised
update turns a rounding-level gradient difference into an lr-sized step), and dropout switched off by default
(graphtrain's fused dropout draws its masks from its own hash RNG, so with dropout on those passes change the
random stream by design; with ``keep_dropout`` such a configuration is recognised by the generator state it
leaves and reported, not judged).

Side effects: each configuration starts from ``torch._dynamo.reset()`` (the same model compiles dozens of
times, past Dynamo's recompile limit), so other compiled functions in the process recompile on their next
call; the fallback policy (``silent`` meanwhile) and the caller's generator state are restored afterwards; a
fast path that fails at run time stays off for the process, as in training (its row says so).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch

from graphtrain.config import fallback as fallback_policy
from graphtrain.config.sections import EngineConfig, resolve_engine_config
from graphtrain.frontend.accelerate import accelerate
from graphtrain.kernels import KERNELS, capability
from graphtrain.kernels._common import force_reference, runtime_fallbacks
from graphtrain.passes.manager import STAGES, pipeline, registered_passes
from graphtrain.testing import TOLERANCES
from graphtrain.tools.bisect_report import BisectReport, ConfigResult
from graphtrain.tools.bisect_run import Run, compare, device_of, rng_state, same_rng, switch_off_dropout, train

PROVIDERS = ("aten", "inductor")
PRECISIONS = ("fp32", "bf16", "fp16", "auto")
_LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}
_DTYPE_NAMES = {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


# --------------------------------------------------------------------------------------- the scan ----


class _Bisector:
    def __init__(
        self,
        model_factory: Callable[[], torch.nn.Module],
        batch: Any,
        *,
        steps: int,
        provider: str,
        precision: str,
        seed: int,
        loss_fn: Any,
        lr: float,
        keep_dropout: bool,
        alone: bool,
        engine: EngineConfig,
    ) -> None:
        self.factory, self.batch, self.steps, self.seed, self.loss_fn, self.lr = (
            model_factory,
            batch,
            steps,
            seed,
            loss_fn,
            lr,
        )
        self.provider, self.keep_dropout, self.alone, self.base = provider, keep_dropout, alone, engine
        self.rows: list[ConfigResult] = []
        self.cache: dict[tuple, Run] = {}
        self.last_model: torch.nn.Module | None = None

        self.eager_model = self._new_model()
        self.device = device_of(self.eager_model, batch)
        self.precision = capability.resolve_precision(precision, self.device.type)
        self.dropout_changes = [] if keep_dropout else switch_off_dropout(self.eager_model)
        self.initial = {k: v.detach().clone() for k, v in self.eager_model.state_dict().items()}
        torch.manual_seed(seed)
        seeded = [rng_state(self.device)]
        self.eager = train(self.eager_model, batch, loss_fn, steps, seed, lr, self.device)
        for s in range(1, steps):
            torch.manual_seed(seed + s)
            seeded.append(rng_state(self.device))
        # Did eager draw random numbers? Then a configuration that draws differently cannot be compared.
        self.eager_random = any(not same_rng(seeded[s], self.eager[s].rng) for s in range(steps))

        target = dataclasses.replace(engine, provider=provider, precision=self.precision)
        self.pipeline: list[str] = []
        for stage in STAGES:
            self.pipeline += [s.name for s in pipeline(stage, target) if s.name not in self.pipeline]
        self.specs = registered_passes()

    # -- models and runs ---------------------------------------------------------------------------------

    def _new_model(self) -> torch.nn.Module:
        m = self.factory()
        if not isinstance(m, torch.nn.Module):
            raise TypeError(f"model_factory must return a torch.nn.Module, got {type(m).__name__}")
        if m is getattr(self, "eager_model", None) or m is self.last_model:
            raise ValueError(
                "model_factory returned a model it returned before: it must build a new one each call "
                "(e.g. lambda: MyModel(), not lambda: model)"
            )
        return m.train()

    def _run(self, passes: list[str], fast_ops: list[str], provider: str) -> Run:
        key = (tuple(sorted(passes)), tuple(sorted(fast_ops)), provider)
        if key in self.cache:
            return self.cache[key]
        torch._dynamo.reset()
        model = self._new_model()
        self.last_model = model
        if not self.keep_dropout:
            switch_off_dropout(model)
        model.load_state_dict(self.initial)
        on = set(passes)
        cfg = dataclasses.replace(
            self.base,
            provider=provider,
            precision=self.precision,
            fallback="silent",
            passes={n: n in on for n in self.specs},
        )
        n_fallbacks = len(runtime_fallbacks())
        steps, error, notes = None, None, []
        t0 = time.perf_counter()
        with force_reference(None, except_for=fast_ops) as chosen:
            try:
                accelerate(model, cfg)
                steps = train(model, self.batch, self.loss_fn, self.steps, self.seed, self.lr, self.device)
            except Exception as e:  # noqa: BLE001 - a configuration that raises is a result, not the end of the scan
                error = " ".join(f"{type(e).__name__}: {e}".split())[:500]
        seconds = time.perf_counter() - t0
        state = getattr(model, "_graphtrain", None)
        if state is None:  # accelerate itself raised
            torch._dynamo.reset()
            return Run(steps, error, {}, set(chosen), notes, seconds)
        rewrites: dict[str, int] = {}
        for r in state.passes:
            if r.left_to is None:
                rewrites[r.name] = rewrites.get(r.name, 0) + r.rewrites
        if state.eager_only:
            notes.append("capture failed, the model ran eagerly: this row does not test the engine")
        notes += [f"{part} fell back: {why[:200]}" for part, why in state.fallbacks]
        ran = {g.provider for g in state.graphs}
        if ran and ran != {provider}:
            notes.append(f"graphs ran on {'/'.join(sorted(ran))}, not {provider}")
        notes += [
            f"fast path {f.op} ({f.implementation}) failed at run time and runs its reference from now on: "
            f"{f.reason[:200]}"
            for f in runtime_fallbacks()[n_fallbacks:]
        ]
        torch._dynamo.reset()
        run = Run(steps, error, rewrites, set(chosen), notes, seconds)
        self.cache[key] = run
        return run

    def _row(
        self,
        label: str,
        kind: str,
        target: str | None,
        passes: list[str],
        fast_ops: list[str],
        provider: str = "aten",
        may_be_culprit: bool = True,
    ) -> ConfigResult:
        run = self._run(passes, fast_ops, provider)
        numerics = any(self.specs[p].changes_numerics and run.rewrites.get(p, 0) for p in passes)
        low = _LOW.get(self.precision) if run.rewrites.get("apply_mixed_precision", 0) else None
        row = ConfigResult(
            len(self.rows),
            label,
            kind,
            target,
            "ok",
            provider,
            list(passes),
            list(fast_ops),
            numerics,
            notes=list(run.notes),
            seconds=run.seconds,
        )
        self.rows.append(row)
        if run.error is not None:
            row.status = "error"
            row.notes.append(run.error)
        else:
            self._judge(row, run, low)
        row.culprit = may_be_culprit and row.failed
        return row

    def _tolerance(self, dtype: torch.dtype, low: torch.dtype | None) -> tuple[float, float]:
        r, a = TOLERANCES.get(dtype, (0.0, 0.0))
        if low is not None:  # mixed precision: the compute dtype's tolerance, which is looser
            lr_, la = TOLERANCES[low]
            r, a = max(r, lr_), max(a, la)
        return r, a

    def _judge(self, row: ConfigResult, run: Run, low: torch.dtype | None) -> None:
        bitwise = True
        assert run.steps is not None
        for s, (got, ref) in enumerate(zip(run.steps, self.eager)):
            pairs = [("loss", got.loss, ref.loss)] + [
                (f"grad of {n}", got.grads.get(n), g) for n, g in ref.grads.items()
            ]
            errs = []
            for name, a, e in pairs:
                like = e if e is not None else a
                dtype = like.dtype if like is not None else torch.float32
                errs.append(compare(name, s, a, e, *self._tolerance(dtype, low)))
            bitwise = bitwise and all(e.max_abs == 0 for e in errs)
            worst = max(errs, key=lambda e: e.ratio)
            if row.worst is None or worst.ratio > row.worst.ratio:
                row.worst = worst
            bad = [e for e in errs if not e.ok]
            row.out_of_tolerance += len(bad)
            if bad and row.first_failure is None:
                row.first_failure = max(bad, key=lambda e: e.ratio)
            if self.eager_random and not same_rng(got.rng, ref.rng):
                row.status = "rng differs"
        if row.status == "rng differs":
            row.notes.append(
                "the generator's state after a step differs from eager's: this configuration draws "
                "random numbers differently (fused dropout's own RNG), so it is reported, not judged"
            )
            return
        row.status = "FAIL" if row.first_failure is not None else ("bitwise" if bitwise else "ok")

    # -- the stages --------------------------------------------------------------------------------------

    def scan(self) -> None:
        every_pass = list(self.pipeline)
        full = self._run(every_pass, [], "aten")  # the rewrite counts say which passes can change the graph
        base = self._row("engine, no passes (capture + AOTAutograd)", "engine", "capture + AOTAutograd", [], [])
        if base.failed:
            return  # every later row would inherit the engine's own difference

        on: list[str] = []
        for name in every_pass:
            if full.error is None and not full.rewrites.get(name, 0):
                self.rows.append(
                    ConfigResult(len(self.rows), f"+ {name}", "pass", name, "no rewrites", "aten", [*on, name], [])
                )
                on.append(name)
                continue
            row = self._row(f"+ {name}", "pass", name, [*on, name], [])
            if not row.culprit:
                on.append(name)  # a culprit is switched off again for the rows after it
        if self.alone:
            for name in every_pass:
                if full.error is not None or full.rewrites.get(name, 0):
                    self._row(f"only {name}", "pass alone", name, [name], [], may_be_culprit=False)

        fast = self._fused_ops(on)
        if self.provider != "aten":
            self._row(f"provider {self.provider}", "provider", self.provider, on, fast, provider=self.provider)

    def _fused_ops(self, on: list[str]) -> list[str]:
        """Stage 3: each fused op's fast paths on top of the passes `on`; returns the ops whose fast paths passed."""
        # Which fast paths the final pass configuration chose (all were forced to their reference there).
        chosen = set(self._run(on, [], "aten").chosen)
        fast: list[str] = []
        tried: set[str] = set()
        while True:
            groups = _group(chosen, tried)
            if not groups:
                break
            ops, impls = groups[0]
            tried.update(ops)
            label = "fast " + ", ".join(
                ("backward" if op == f"{ops[0]}_backward" else op) + f" ({impls[op]})" for op in ops
            )
            row = self._row(label, "fused op", ", ".join(ops), on, [*fast, *ops])
            chosen |= self._run(on, [*fast, *ops], "aten").chosen  # a fast path may use another (attention: gemm)
            bad = row.culprit
            forward = [op for op in ops if not op.endswith("_backward")]
            if bad and 0 < len(forward) < len(ops):
                fwd = self._row(
                    "  " + ", ".join(f"{op} ({impls[op]})" for op in forward) + " alone",
                    "fused op",
                    ", ".join(forward),
                    on,
                    [*fast, *forward],
                    may_be_culprit=False,
                )
                if fwd.failed:  # the forward is wrong: name it instead of the pair
                    row.culprit, fwd.culprit = False, True
                else:
                    backward = [op for op in ops if op not in forward]
                    row.target = ", ".join(backward)
                    row.notes.append(
                        f"the forward alone is within tolerance (row {fwd.index}): the backward ({row.target}) is out"
                    )
            if not bad:  # a wrong fast path runs its reference in the rows after it
                fast += ops
        return fast

    def report(self, model_name: str) -> BisectReport:
        dtypes = {ref.loss.dtype for ref in self.eager} | {
            g.dtype for ref in self.eager for g in ref.grads.values() if g is not None
        }
        if self.precision in _LOW:
            dtypes.add(_LOW[self.precision])
        tol = {_DTYPE_NAMES.get(d, str(d)): TOLERANCES[d] for d in sorted(dtypes, key=str) if d in TOLERANCES}
        if self.keep_dropout:
            drop = (
                "kept (keep_dropout): configurations that draw random numbers differently from eager are "
                "reported, not judged"
            )
        elif self.dropout_changes:
            shown = ", ".join(self.dropout_changes[:4]) + (
                f", +{len(self.dropout_changes) - 4} more" if len(self.dropout_changes) > 4 else ""
            )
            n = len(self.dropout_changes)
            drop = (
                f"switched off in {n} place{'s' if n > 1 else ''} ({shown}), so fused dropout's own RNG "
                f"cannot differ by design; keep_dropout keeps it"
            )
        else:
            drop = "none found"
        notes = []
        if self.eager_random and not self.keep_dropout:
            notes.append(
                "eager draws random numbers in training even with dropout switched off: a configuration "
                "that draws them differently is reported, not judged"
            )
        return BisectReport(
            model_name,
            self.steps,
            self.lr,
            self.seed,
            self.provider,
            self.precision,
            tol,
            drop,
            [float(s.loss) for s in self.eager],
            self.rows,
            notes,
        )


def _group(chosen: set[tuple[str, str]], tried: set[str]) -> list[tuple[list[str], dict[str, str]]]:
    """The fast paths not tried yet, grouped by fused op (an op with its ``_backward``), in KERNELS order."""
    found: dict[str, set[str]] = {}
    for op, impl in chosen:
        if op not in tried:
            found.setdefault(op, set()).add(impl)
    impls = {op: "/".join(sorted(v)) for op, v in sorted(found.items())}
    groups: dict[str, list[str]] = {}
    for op in impls:
        groups.setdefault(op[: -len("_backward")] if op.endswith("_backward") else op, []).append(op)
    order = list(KERNELS)
    keys = sorted(groups, key=lambda k: (order.index(k) if k in order else len(order), k))
    return [(sorted(groups[k], key=lambda op: op.endswith("_backward")), impls) for k in keys]


def bisect(
    model_factory: Callable[[], torch.nn.Module],
    batch: Any,
    *,
    steps: int = 3,
    provider: str = "aten",
    precision: str = "fp32",
    seed: int = 0,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    lr: float = 1e-2,
    keep_dropout: bool = False,
    alone: bool = False,
    engine: EngineConfig | dict | None = None,
    name: str | None = None,
) -> BisectReport:
    """Find the first pass, fused op or provider whose forward or backward takes training out of tolerance.

    `model_factory()` builds the model (called once per configuration; weights are copied from the first one, so
    it need not seed). `batch`: keyword arguments (dict), positional arguments (tuple) or one tensor; the model's
    output must be the loss (a scalar, or an output with ``.loss``/``["loss"]``) unless `loss_fn(output)` makes
    it. `provider`: the provider to end on (aten | inductor). `precision`: the engine's compute precision
    (fp32 | bf16 | fp16 | auto; low precision is judged by that dtype's tolerance once mixed precision is on).
    `keep_dropout`: leave dropout on (see the module docstring). `alone`: also run each pass on its own.
    `engine`: other engine settings every configuration shares (an EngineConfig or dict; its `passes` decide
    which passes the pipeline has). See the module docstring for what runs; `print()` the report."""
    if provider == "auto":
        provider = "inductor"  # what the engine picks (engine.providers.resolve_provider)
    if provider not in PROVIDERS:
        raise ValueError(f"provider must be one of {', '.join(PROVIDERS)} (or auto), got {provider!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    if not lr > 0:
        raise ValueError(f"lr must be positive, got {lr!r}")
    if not callable(model_factory):
        raise TypeError(
            "model_factory must be a callable that builds the model (e.g. lambda: MyModel()), got "
            f"{type(model_factory).__name__}"
        )
    base = resolve_engine_config(engine, {})
    policy = fallback_policy.policy()
    # The caller's generator state is theirs: every step here reseeds it.
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=cuda):
        try:
            return _bisect(
                model_factory,
                batch,
                steps=steps,
                provider=provider,
                precision=precision,
                seed=seed,
                loss_fn=loss_fn,
                lr=lr,
                keep_dropout=keep_dropout,
                alone=alone,
                engine=base,
                name=name,
            )
        finally:
            fallback_policy.set_policy(policy)
            torch._dynamo.reset()


def _bisect(model_factory: Callable[[], torch.nn.Module], batch: Any, *, name: str | None, **kw: Any) -> BisectReport:
    b = _Bisector(model_factory, batch, **kw)
    b.scan()
    n_params = sum(p.numel() for p in b.eager_model.parameters() if p.requires_grad)
    return b.report(f"{name or type(b.eager_model).__name__} ({n_params:,} trained parameters)")
