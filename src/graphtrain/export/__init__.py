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
"""
from __future__ import annotations

from graphtrain.export.export import FORMATS, ONNX_ATOL, export_run, load_run

__all__ = ["FORMATS", "ONNX_ATOL", "export_run", "load_run"]
