"""What ``graphtrain.bisect`` reports (tools/bisect.py runs the configurations): each configuration's result, its
worst tensor against eager's, the culprit and the advice printed for it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class TensorError:
    """One tensor of one step compared with eager's."""

    tensor: str  # "loss" or "grad of <parameter>"
    step: int
    max_abs: float  # max |engine - eager| over the tensor
    rel: float  # |engine - eager| / |eager| at the element furthest out of tolerance
    ratio: float  # max over elements of |engine - eager| / (atol + rtol * |eager|): above 1 is out of tolerance
    rtol: float
    atol: float

    @property
    def ok(self) -> bool:
        return self.ratio <= 1.0

    def describe(self) -> str:
        return (
            f"{self.tensor} at step {self.step}: max abs err {self.max_abs:.3g}, rel err {self.rel:.3g} "
            f"({self.ratio:.3g}x the tolerance rtol {self.rtol:g}, atol {self.atol:g})"
        )


@dataclass
class ConfigResult:
    """One configuration of the engine and how far it left eager."""

    index: int
    label: str  # as the table shows it
    kind: str  # engine | pass | pass alone | fused op | provider
    target: str | None  # the pass, fused op(s) or provider this row switched on
    status: str  # bitwise | ok | FAIL | error | rng differs | no rewrites
    provider: str
    passes: list[str]  # passes on
    fast_ops: list[str]  # fused ops running their fast implementations (the others run their reference)
    changes_numerics: bool = False  # a pass on here changes numerics by design (judged by the tolerance alone)
    worst: TensorError | None = None  # the tensor closest to (or furthest beyond) its tolerance
    first_failure: TensorError | None = None  # the worst tensor out of tolerance at the first step that had one
    out_of_tolerance: int = 0  # (tensor, step) pairs out of tolerance
    culprit: bool = False
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return self.status in ("FAIL", "error")


@dataclass
class BisectReport:
    model: str
    steps: int
    lr: float
    seed: int
    provider: str
    precision: str
    tolerances: dict[str, tuple[float, float]]  # dtype name -> (rtol, atol) used
    dropout: str  # what was done about dropout
    eager_losses: list[float]
    configs: list[ConfigResult]
    notes: list[str] = field(default_factory=list)

    @property
    def culprits(self) -> list[ConfigResult]:
        return [c for c in self.configs if c.culprit]

    @property
    def culprit(self) -> ConfigResult | None:
        """The first configuration out of tolerance (None: every configuration is within it)."""
        return next(iter(self.culprits), None)

    @property
    def ok(self) -> bool:
        return self.culprit is None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["culprit"] = None if self.culprit is None else self.culprit.index
        d["ok"] = self.ok
        return d

    def __str__(self) -> str:
        tol = ", ".join(f"{k}: rtol {r:g}, atol {a:g}" for k, (r, a) in self.tolerances.items())
        losses = ", ".join(f"{x:.6g}" for x in self.eager_losses)
        L = [
            f"graphtrain bisect: {self.model}; {self.steps} SGD steps (lr {self.lr:g}, seed {self.seed}), "
            f"provider {self.provider}, precision {self.precision}",
            f"compared with eager at every step: the loss and every parameter gradient (tolerance {tol})",
            f"dropout: {self.dropout}",
            f"eager loss per step: {losses}",
            "passes and fused ops are bisected under the aten provider; fused ops run their reference "
            "implementation until their own row",
            "",
        ]
        L.append(
            f"  {'#':>2}  {'configuration':<52} {'status':<11} {'max abs':>9} {'rel err':>9} {'x tol':>8}  "
            f"worst tensor (step)"
        )
        for c in self.configs:
            w = c.worst
            if w is None or w.max_abs == 0:  # not run, or bitwise: no tensor to name
                nums = f"{'':>9} {'':>9} {'':>8}  -" if w is None else f"{0:>9} {0:>9} {0:>8}  -"
            else:
                nums = f"{w.max_abs:>9.2g} {w.rel:>9.2g} {w.ratio:>8.2g}  {w.tensor} ({w.step})"
            status = c.status + ("*" if c.changes_numerics and c.status == "ok" else "")
            mark = ">" if c.culprit else " "
            L.append(f"{mark} {c.index:>2}  {_clip(c.label, 52):<52} {status:<11} {nums}".rstrip())
        if any(c.changes_numerics and c.status == "ok" for c in self.configs):
            L.append("  * a pass that changes numerics by design is on: judged by the tolerance alone")
        noted = [c for c in self.configs if c.notes]
        if noted:
            L.append("notes:")
            L += [f"  row {c.index}: {n}" for c in noted for n in c.notes]
        L += [f"note: {n}" for n in self.notes]
        culprits = self.culprits
        if not culprits:
            judged = sum(c.status in ("bitwise", "ok") for c in self.configs)
            L.append(
                f"no culprit: all {judged} configurations run are within tolerance of eager"
                + (" (some were not judged, see above)" if any(c.status == "rng differs" for c in self.configs) else "")
            )
            return "\n".join(L)
        for i, c in enumerate(culprits):
            what = {
                "engine": "the engine without any pass",
                "pass": f"pass {c.target}",
                "fused op": f"fused op {c.target}",
                "provider": f"provider {c.target}",
            }.get(c.kind, c.label)
            head = "CULPRIT" if i == 0 else "also out of tolerance (with the culprits before it off)"
            if c.status == "error":
                L.append(f"{head}: row {c.index}, {what}: raised {c.notes[-1] if c.notes else ''}")
            else:
                f = c.first_failure
                L.append(
                    f"{head}: row {c.index}, {what}: {f.describe() if f else ''}; "
                    f"{c.out_of_tolerance} tensor-steps out of tolerance"
                )
            L.append(f"  {_advice(c)}")
        return "\n".join(L)


def _clip(s: str, n: int) -> str:
    return s if len(s) <= n else s[: n - 3] + "..."


def _advice(c: ConfigResult) -> str:
    if c.kind == "pass":
        return f"switch it off with engine.passes.{c.target}=false"
    if c.kind == "fused op":
        return (
            "its reference implementation is within tolerance in the rows before: the fast path is wrong "
            "(graphtrain.kernels._common.force_reference runs the reference instead)"
        )
    if c.kind == "provider":
        return "the same graph is within tolerance under the aten provider: use engine.provider=aten"
    return "the captured graph itself differs from eager: no pass can be judged (graph breaks, nondeterminism?)"
