"""Reference models: GPT-2 (causal LM) and BERT (masked LM), written for clarity like nanoGPT.

from graphtrain.models import build_model
model = build_model(config.model, vocab_size=data.vocab_size)
loss = model(**batch)          # batch from graphtrain.data: logits without labels, loss with
"""

from graphtrain.models.bert import BERT
from graphtrain.models.gpt2 import GPT2
from graphtrain.models.presets import PRESETS, build_model, count_parameters, get_spec, resolve_spec
from graphtrain.models.spec import ModelSpec

__all__ = ["BERT", "GPT2", "PRESETS", "ModelSpec", "build_model", "count_parameters", "get_spec", "resolve_spec"]
