"""Batches for training and evaluation, deterministic in (seed, split, step).

`get_batch(step, batch_size)` seeds its own torch.Generator from (train.seed, split, step), so
a resumed run sees exactly the batches an uninterrupted one would, with no state to checkpoint.

    gpt2: {"input_ids", "labels"}                  labels[:, t] = the token after input_ids[:, t]
    bert: {"input_ids", "attention_mask", "token_type_ids", "labels"}
          [CLS] + seq_len-2 tokens + [SEP]; mlm_probability of the ordinary tokens are selected, of
          which 80% become [MASK], 10% a random token, 10% stay; labels are -100 elsewhere.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from graphtrain.config import Config
from graphtrain.data.tokenizer import CodeTokenizer, TokenizedCorpus, load_or_build

IGNORE_INDEX = -100
Family = Literal["gpt2", "bert"]


def _step_seed(seed: int, split: str, step: int) -> int:
    """A 63-bit seed fixed by (seed, split, step) on every machine and Python version."""
    digest = hashlib.sha256(f"graphtrain-batch:{seed}:{split}:{step}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


class BatchSource:
    """Random windows of one split's token stream, drawn deterministically per step."""

    def __init__(self, tokens: np.ndarray | torch.Tensor, *, family: Family, split: str, seq_len: int, seed: int,
                 tokenizer: CodeTokenizer, mlm_probability: float = 0.15) -> None:
        if family not in ("gpt2", "bert"):
            raise ValueError(f"family must be 'gpt2' or 'bert', got {family!r}")
        self.tokens = torch.as_tensor(np.asarray(tokens, dtype=np.int32)) if isinstance(tokens, np.ndarray) \
            else tokens.to(torch.int32)
        self.family, self.split, self.seq_len, self.seed = family, split, seq_len, seed
        self.tokenizer = tokenizer
        self.mlm_probability = mlm_probability
        self.vocab_size = tokenizer.vocab_size
        # gpt2 windows hold seq_len inputs plus the last target; bert windows seq_len-2 ordinary tokens.
        if family == "bert" and seq_len < 3:
            raise ValueError(f"data.seq_len must be >= 3 for BERT ([CLS] + tokens + [SEP]), got {seq_len}")
        self.window = seq_len + 1 if family == "gpt2" else seq_len - 2
        n = self.tokens.numel()
        if n < self.window:
            raise ValueError(f"the {split} split has only {n} tokens, too few for data.seq_len={seq_len} "
                             f"(a sample needs {self.window}): lower data.seq_len, or give it more text "
                             f"(raise data.max_bytes or data.val_fraction, or add files to data.path)")
        self._specials = torch.tensor(tokenizer.special_ids)
        self._first_ordinary = max(tokenizer.special_ids) + 1

    @property
    def n_tokens(self) -> int:
        return self.tokens.numel()

    def generator(self, step: int) -> torch.Generator:
        return torch.Generator().manual_seed(_step_seed(self.seed, self.split, step))

    def get_batch(self, step: int, batch_size: int) -> dict[str, torch.Tensor]:
        """The batch for `step` (same step, same batch); tensors on the CPU, token ids as torch.long."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        g = self.generator(step)
        starts = torch.randint(0, self.n_tokens - self.window + 1, (batch_size,), generator=g)
        windows = self.tokens[starts[:, None] + torch.arange(self.window)].long()
        if self.family == "gpt2":
            return {"input_ids": windows[:, :-1].contiguous(), "labels": windows[:, 1:].contiguous()}
        return self._mask(windows, g)

    def _mask(self, windows: torch.Tensor, g: torch.Generator) -> dict[str, torch.Tensor]:
        B = windows.size(0)
        cls = torch.full((B, 1), self.tokenizer.cls_id, dtype=torch.long)
        sep = torch.full((B, 1), self.tokenizer.sep_id, dtype=torch.long)
        input_ids = torch.cat([cls, windows, sep], dim=1)
        special = torch.isin(input_ids, self._specials)  # [CLS], [SEP] and <|endoftext|> between documents

        selected = (torch.rand(input_ids.shape, generator=g) < self.mlm_probability) & ~special
        # Every row gets at least one prediction, so a tiny batch never yields a 0/0 loss.
        fallback = torch.rand(input_ids.shape, generator=g).masked_fill(special, -1.0).argmax(dim=1)
        empty = ~selected.any(dim=1) & ~special.all(dim=1)
        selected[empty, fallback[empty]] = True

        labels = input_ids.masked_fill(~selected, IGNORE_INDEX)
        action = torch.rand(input_ids.shape, generator=g)
        to_mask = selected & (action < 0.8)
        to_random = selected & (action >= 0.8) & (action < 0.9)
        random_ids = torch.randint(self._first_ordinary, self.vocab_size, input_ids.shape, generator=g)
        input_ids = input_ids.masked_fill(to_mask, self.tokenizer.mask_id)
        input_ids = torch.where(to_random, random_ids, input_ids)
        return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
                "token_type_ids": torch.zeros_like(input_ids), "labels": labels}


@dataclass
class DataBundle:
    tokenizer: CodeTokenizer
    train: BatchSource
    val: BatchSource
    info: dict  # corpus root, file and token counts, build timings, cache folder

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size


def build_data(config: Config, family: str) -> DataBundle:
    """Corpus -> tokenizer -> token ids (cached) -> train/val batch sources for `family`."""
    if not isinstance(config, Config):
        raise TypeError(f"build_data expects a graphtrain.Config, got {type(config).__name__}")
    if family not in ("gpt2", "bert"):
        raise ValueError(f"family must be 'gpt2' or 'bert' (the model's .family), got {family!r}")
    data = config.data
    tc: TokenizedCorpus = load_or_build(data)
    common = dict(family=family, seq_len=data.seq_len, seed=config.train.seed, tokenizer=tc.tokenizer,
                  mlm_probability=data.mlm_probability)
    info = {**tc.stats, "cache_dir": str(tc.cache_dir), "from_cache": tc.from_cache}
    return DataBundle(tokenizer=tc.tokenizer, train=BatchSource(tc.train, split="train", **common),
                      val=BatchSource(tc.val, split="val", **common), info=info)
