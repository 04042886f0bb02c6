"""``graphtrain export RUN_DIR --format safetensors|hf|onnx``: what a run trained, in the formats others load.

- ``safetensors``: the model's weights (tied matrices stored once), for ``safetensors.torch.load_file`` and
  ``load_state_dict`` into the same architecture (``graphtrain.models.build_model``).
- ``hf``: a Hugging Face model folder (``config.json``, ``model.safetensors``, the run's tokenizer) that
  ``AutoModelForCausalLM`` / ``AutoModelForMaskedLM.from_pretrained`` loads: graphtrain's GPT-2 becomes
  ``GPT2LMHeadModel`` (exact GELU: ``activation_function="gelu"``), its post-LayerNorm BERT ``BertForMaskedLM``;
  the weights are mapped (GPT-2's Conv1D layout is the transposed Linear; BERT's fused qkv is split).
- ``onnx``: the inference graph (``torch.onnx.export``, the dynamo exporter) with dynamic batch and sequence
  axes, checked with onnxruntime against PyTorch on two batch shapes: the largest absolute logit difference is
  reported and must stay within ``ONNX_ATOL`` (fp32).

Each format is checked after writing: the exported model is loaded with its consumer library and its logits
compared with the trained model's on a sample batch (``max_abs_diff`` in the result).

Here: load a run's checkpoint, write each format, load it back, compare logits.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from graphtrain.config.sections import Config, ModelConfig
from graphtrain.data import build_data
from graphtrain.models import build_model, resolve_spec
from graphtrain.models.hf_export import write_hf_folder
from graphtrain.trainer.checkpoint import (
    checkpoint_tokenizer,
    is_sharded,
    latest_valid_checkpoint,
    list_checkpoints,
    load_checkpoint,
    to_module_keys,
)
from graphtrain.trainer.console import quiet_libraries
from graphtrain.trainer.run_outputs import best_checkpoint

FORMATS = ("safetensors", "hf", "onnx")
ONNX_ATOL = 1e-4


_PACKAGES = {
    "safetensors": ("safetensors",),
    "hf": ("safetensors", "transformers"),
    "onnx": ("onnx", "onnxscript", "onnxruntime"),
}


def _require(fmt: str) -> None:
    """Each package the format's writer and checker import, before anything is read or written: a missing one is
    one line naming it (it was a RuntimeError traceback, after the model was loaded)."""
    import importlib

    missing = []
    for module in _PACKAGES[fmt]:
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise ValueError(
            f"export --format {fmt} needs {', '.join(missing)} (not installed): pip install "
            f"'graphtrain[export]' (or {' '.join(missing)})"
        )


def load_run(run_dir: str | Path, checkpoint: str = "latest") -> tuple[Any, torch.nn.Module, Path]:
    """(the run's Config, its model with the checkpoint's weights, in eval mode, the checkpoint) of a run folder.
    `checkpoint`: latest (the newest that verifies), best (train.keep_best's ckpt-best), a step number, or a
    checkpoint path."""
    run = Path(run_dir)
    if not (run / "config.yaml").is_file():
        raise ValueError(
            f"{str(run)!r} is not a graphtrain run directory (no config.yaml): pass the train.out_dir "
            f"of a `graphtrain train`"
        )
    config = Config.from_yaml(run / "config.yaml")
    if checkpoint == "latest":
        path = latest_valid_checkpoint(run)
        if path is None:
            raise ValueError(
                f"{str(run)!r} has no valid checkpoint (ckpt-*): train it first (train.ckpt_every "
                f"saves them; a finished run always has one)"
            )
    elif checkpoint == "best":
        path = best_checkpoint(run)
        if path is None:
            raise ValueError(
                f"{str(run)!r} has no best checkpoint (ckpt-best.pt): train with train.keep_best=true, "
                f"or export --checkpoint latest"
            )
    elif checkpoint.isdigit():
        path = next((p for s, p in list_checkpoints(run) if s == int(checkpoint)), None)
        if path is None:
            raise ValueError(
                f"{str(run)!r} has no checkpoint of step {checkpoint}; it has steps "
                f"{[s for s, _ in list_checkpoints(run)]}"
            )
    else:
        path = Path(checkpoint)
    if is_sharded(path):
        raise ValueError(
            f"{str(path)!r} is a sharded (distributed) checkpoint: resume it in one process to write a "
            f"single-file one (graphtrain train --resume with parallel.dp=1), then export that"
        )
    state = load_checkpoint(path, config)
    weights = state["model"]
    if config.model.hf is not None:  # its config (with the run's overrides) gives every size
        model = build_model(config.model)
    else:
        emb = next(v for k, v in weights.items() if k.endswith(("wte.weight", "embeddings.word.weight")))
        model = build_model(
            ModelConfig(**{**config.model.__dict__, "vocab_size": int(emb.shape[0])}), vocab_size=int(emb.shape[0])
        )
    model.load_state_dict(to_module_keys(weights, model))
    return config, model.eval(), path


@quiet_libraries()  # other libraries' progress bars and chatter (trainer/console.py)
def export_run(
    run_dir: str | Path, fmt: str, out: str | Path | None = None, *, checkpoint: str = "latest", force: bool = False
) -> dict[str, Any]:
    """Export the run; returns {format, out, checkpoint, max_abs_diff, ...}.

    The export is written into a temporary folder beside `out` and renamed into place once it is complete and
    checked, so an interrupted export leaves no half-written `out` (at most a `.NAME.*.tmp` folder beside it) and
    an earlier export that `force` replaces stays in place until then. `force` replaces only an earlier export:
    a folder holding anything an export does not write (a run folder, a folder that holds one, a checkpoint) is
    refused, as is `out` being the run folder or one of its parents."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; choose from {list(FORMATS)}")
    _require(fmt)
    out = Path(out).expanduser() if out is not None else Path(run_dir) / f"export-{fmt}"
    _check_out(out, Path(run_dir), force)
    config, model, ckpt = load_run(run_dir, checkpoint)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp's 0700: an export is for others to read
        sample = _sample(model, batch=2, seq=min(16, model.max_seq_len))
        with torch.no_grad():
            ref = model(sample)
        result: dict[str, Any] = {"format": fmt, "out": str(out), "checkpoint": str(ckpt), "model": config.model.label}
        if fmt == "safetensors":
            written = _safetensors(model, tmp, sample, ref)
        elif fmt == "hf":
            written = _hf(model, config, tmp, sample, ref, ckpt)
        else:
            written = _onnx(model, tmp, sample, ref)
        # the files are named where they will be once the folder is in place
        result.update({k: v.replace(str(tmp), str(out)) if isinstance(v, str) else v for k, v in written.items()})
        (tmp / "export.json").write_text(json.dumps(result, indent=2))
        _replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return result


# What an export writes, and so all that --force may delete: safetensors, Hugging Face (save_pretrained and the
# tokenizer files) and ONNX (a large graph's external data file) outputs, and export.json.
_EXPORT_FILE = re.compile(
    r"^(export\.json|config\.json|generation_config\.json|tokenizer(_config)?\.json|"
    r"special_tokens_map\.json|model(-\d{5}-of-\d{5})?\.safetensors|"
    r"model\.safetensors\.index\.json|model\.onnx(\.data|_data)?)$"
)


def _check_out(out: Path, run: Path, force: bool) -> None:
    """Refuse an --out that would overwrite or delete the run, or anything but an earlier export (usage errors)."""
    target, run_r = out.resolve(), run.expanduser().resolve()
    fix = f"choose another --out (the default is {str(run / 'export-FORMAT')!r})"
    if target == run_r or run_r.is_relative_to(target):
        what = "the run folder itself" if target == run_r else f"a folder that holds the run {str(run)!r}"
        raise ValueError(f"--out {str(out)!r} is {what}: an export never writes over a run; {fix}")
    if not (out.exists() or out.is_symlink()):
        return
    if not out.is_dir():
        raise ValueError(f"--out {str(out)!r} is a file; an export is a folder: {fix}")
    entries = sorted(out.iterdir())
    if not entries:
        return
    if not force:
        raise ValueError(f"{str(out)!r} exists and is not empty: choose another --out, or --force to replace it")
    foreign = [p.name for p in entries if not (_EXPORT_FILE.match(p.name) and p.is_file() and not p.is_symlink())]
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise ValueError(
            f"--force replaces only an earlier export, and {str(out)!r} holds {shown}, which an export "
            f"does not write (a run, checkpoints or your own files?): {fix}, or move that folder away "
            f"yourself"
        )


def _replace(tmp: Path, out: Path) -> None:
    """Move the finished export `tmp` to `out`, an earlier export there (checked by `_check_out`) deleted after."""
    old = None
    if out.is_dir() and any(out.iterdir()):
        old = out.with_name(f".{out.name}.{os.getpid()}.old")
        os.replace(out, old)
    elif out.is_dir():
        out.rmdir()
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _sample(model: torch.nn.Module, batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.spec.vocab_size, (batch, seq), generator=g)


def _diff(a: Any, b: Any) -> float:
    return float((torch.as_tensor(a).float() - torch.as_tensor(b).float()).abs().max())


def _safetensors(model: torch.nn.Module, out: Path, sample: torch.Tensor, ref: torch.Tensor) -> dict[str, Any]:
    from safetensors.torch import load_file, save_model

    path = out / "model.safetensors"
    if getattr(model.spec, "hf_type", None):  # a model.hf run: the transformers model's own weights and names
        model = _HFLogits(model.hf)
        save_model(model.hf, str(path))
        again = _HFLogits(type(model.hf)(model.hf.config))
        missing, unexpected = again.hf.load_state_dict(load_file(str(path)), strict=False)
        again.hf.tie_weights()
        if unexpected or any(k not in _tied_keys(model.hf) for k in missing):
            raise RuntimeError(f"safetensors round trip lost weights: missing {missing}, unexpected {unexpected}")
        with torch.no_grad():
            return {"file": str(path), "max_abs_diff": _diff(again.eval()(sample), ref)}
    save_model(model, str(path))  # a tied matrix is stored once
    again = type(model)(model.spec, attention=model.attention)  # what a user of the file builds
    missing, unexpected = again.load_state_dict(load_file(str(path)), strict=False)
    again.tie_weights()  # the tied copy that was stored once
    if unexpected or any(k not in _tied_keys(model) for k in missing):
        raise RuntimeError(f"safetensors round trip lost weights: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        return {"file": str(path), "max_abs_diff": _diff(again.eval()(sample), ref)}


def _tied_keys(model: torch.nn.Module) -> set[str]:
    seen: dict[int, str] = {}
    tied = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            tied |= {name, seen[id(p)]}
        seen.setdefault(id(p), name)
    return tied


class _HFLogits(torch.nn.Module):
    """A transformers model called as graphtrain's models are: input_ids -> logits."""

    def __init__(self, hf: torch.nn.Module) -> None:
        super().__init__()
        self.hf = hf

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=input_ids).logits


def _hf(
    model: torch.nn.Module, config: Any, out: Path, sample: torch.Tensor, ref: torch.Tensor, ckpt: Path
) -> dict[str, Any]:
    """The Hugging Face folder (models/hf_export.py): the special-token ids in config.json and
    generation_config.json are the exported tokenizer's."""
    tok, note = _run_tokenizer(config, ckpt)
    written = write_hf_folder(model, tok, out, sample, ref)
    return {**written, "tokenizer": str(out / "tokenizer.json") if tok is not None else note}


def _run_tokenizer(config: Any, ckpt: Path) -> tuple[Any, str | None]:
    """(the run's tokenizer: the one the checkpoint holds, for older checkpoints rebuilt from the data cache as the
    run built it; or None and a note saying why there is none)."""
    tok = checkpoint_tokenizer(ckpt)
    if tok is None:
        try:
            tok = build_data(config, family=resolve_spec(config.model).family).tokenizer
        except Exception as e:  # noqa: BLE001 - the weights are exported all the same
            return None, f"not exported: the run's data could not be rebuilt ({type(e).__name__}: {e})"
    if tok is None:
        return None, "not exported: the run trained on token arrays without data.tokenizer"
    return tok, None


def _onnx(model: torch.nn.Module, out: Path, sample: torch.Tensor, ref: torch.Tensor) -> dict[str, Any]:
    try:
        import onnxruntime as ort
    except ImportError:
        raise RuntimeError(
            "ONNX export needs onnx, onnxscript and onnxruntime: pip install graphtrain[export]"
        ) from None
    path = out / "model.onnx"
    batch, seq = torch.export.Dim("batch", min=1, max=1024), torch.export.Dim("seq", min=2, max=model.max_seq_len)
    torch.onnx.export(
        model,
        (sample,),
        str(path),
        dynamo=True,
        verbose=False,
        input_names=["input_ids"],
        output_names=["logits"],
        dynamic_shapes={"input_ids": {0: batch, 1: seq}},
    )
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    other = _sample(model, batch=3, seq=max(2, min(model.max_seq_len, sample.shape[1] + 7)), seed=1)
    diffs = []
    for ids in (sample, other):  # a second shape proves the axes are dynamic
        with torch.no_grad():
            want = model(ids)
        got = session.run(["logits"], {"input_ids": ids.numpy()})[0]
        diffs.append(_diff(torch.from_numpy(got), want))
    worst = max(diffs)
    if worst > ONNX_ATOL:
        raise RuntimeError(
            f"ONNX export of {path}: onnxruntime's logits differ from PyTorch's by {worst:.2e} "
            f"(> {ONNX_ATOL:g}); please report it"
        )
    return {"file": str(path), "max_abs_diff": worst, "shapes_checked": [list(sample.shape), list(other.shape)]}
