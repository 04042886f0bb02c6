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

from graphtrain.config.sections import Config
from graphtrain.data.corpus import source_kind
from graphtrain.data.shards import load_token_shards
from graphtrain.data.tokenizer import CodeTokenizer, TokenizedCorpus, load_or_build, load_user_tokenizer

IGNORE_INDEX = -100
Family = Literal["gpt2", "bert"]


def _step_seed(seed: int, split: str, step: int) -> int:
    """A 63-bit seed fixed by (seed, split, step) on every machine and Python version."""
    digest = hashlib.sha256(f"graphtrain-batch:{seed}:{split}:{step}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


class BatchSource:
    """Random windows of one split's token stream, drawn deterministically per step.

    `tokens` is one array or a list of them (shards: memory-mapped .bin/.npy files stay on disk; a window never
    crosses a shard's end). `tokenizer` may be None for token arrays without one (causal LM only), with
    `vocab_size` then given."""

    def __init__(
        self,
        tokens: np.ndarray | torch.Tensor | list[np.ndarray],
        *,
        family: Family,
        split: str,
        seq_len: int,
        seed: int,
        tokenizer: CodeTokenizer | None,
        mlm_probability: float = 0.15,
        vocab_size: int | None = None,
    ) -> None:
        if family not in ("gpt2", "bert"):
            raise ValueError(f"family must be 'gpt2' or 'bert', got {family!r}")
        shards = tokens if isinstance(tokens, list) else [tokens]
        self.shards = [t.numpy() if isinstance(t, torch.Tensor) else t for t in shards]
        self.family, self.split, self.seq_len, self.seed = family, split, seq_len, seed
        self.tokenizer = tokenizer
        self.mlm_probability = mlm_probability
        self.vocab_size = tokenizer.vocab_size if tokenizer is not None else vocab_size
        if self.vocab_size is None:
            raise ValueError("BatchSource needs a tokenizer or vocab_size")
        # gpt2 windows hold seq_len inputs plus the last target; bert windows seq_len-2 ordinary tokens.
        if family == "bert" and seq_len < 3:
            raise ValueError(f"data.seq_len must be >= 3 for BERT ([CLS] + tokens + [SEP]), got {seq_len}")
        self.window = seq_len + 1 if family == "gpt2" else seq_len - 2
        starts = [max(0, int(t.shape[0]) - self.window + 1) for t in self.shards]
        self._cum_starts = np.cumsum(starts)
        if self._cum_starts[-1] == 0:
            n = max(int(t.shape[0]) for t in self.shards)
            raise ValueError(
                f"the {split} split has only {n} tokens, too few for data.seq_len={seq_len} "
                f"(a sample needs {self.window}): lower data.seq_len, or give it more text "
                f"(raise data.max_bytes or data.val_fraction, or add files to data.path)"
            )
        if family == "bert":
            missing = [
                name for name in ("mask", "cls", "sep") if tokenizer is None or getattr(tokenizer, f"{name}_id") is None
            ]
            if missing:
                raise ValueError(
                    f"masked-LM batches need [MASK], [CLS] and [SEP] tokens; the tokenizer "
                    f"{'is missing' if tokenizer is None else 'has no ' + ', '.join(missing)}: set "
                    f"data.tokenizer to a BERT-style tokenizer, or drop it to train one on the corpus"
                )
            specials = sorted(tokenizer.special_ids)
            self._specials = torch.tensor(specials)
            # random replacement tokens: the ordinary ids (graphtrain's tokenizers put the specials first)
            self._first_ordinary = max(specials) + 1 if specials == list(range(len(specials))) else None
            if self._first_ordinary is None:
                ids = torch.arange(self.vocab_size)
                self._ordinary = ids[~torch.isin(ids, self._specials)]

    @property
    def n_tokens(self) -> int:
        return sum(int(t.shape[0]) for t in self.shards)

    def generator(self, step: int) -> torch.Generator:
        return torch.Generator().manual_seed(_step_seed(self.seed, self.split, step))

    def get_batch(self, step: int, batch_size: int) -> dict[str, torch.Tensor]:
        """The batch for `step` (same step, same batch); tensors on the CPU, token ids as torch.long."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        g = self.generator(step)
        starts = torch.randint(0, int(self._cum_starts[-1]), (batch_size,), generator=g).numpy()
        shard = np.searchsorted(self._cum_starts, starts, side="right")
        offsets = starts - np.concatenate([[0], self._cum_starts])[shard]
        # gathered per shard: only the windows' pages of a memory-mapped shard are read
        rows = [self.shards[s][o : o + self.window] for s, o in zip(shard.tolist(), offsets.tolist())]
        windows = torch.from_numpy(np.stack(rows).astype(np.int64))
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
        if self._first_ordinary is not None:
            random_ids = torch.randint(self._first_ordinary, self.vocab_size, input_ids.shape, generator=g)
        else:
            random_ids = self._ordinary[torch.randint(0, self._ordinary.numel(), input_ids.shape, generator=g)]
        input_ids = input_ids.masked_fill(to_mask, self.tokenizer.mask_id)
        input_ids = torch.where(to_random, random_ids, input_ids)
        return {
            "input_ids": input_ids,
            "attention_mask": torch.ones_like(input_ids),
            "token_type_ids": torch.zeros_like(input_ids),
            "labels": labels,
        }


@dataclass
class DataBundle:
    tokenizer: CodeTokenizer | None  # None: token arrays without data.tokenizer (ids only, nothing to decode)
    train: BatchSource
    val: BatchSource
    info: dict  # corpus root, file and token counts, build timings, cache folder

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size if self.tokenizer is not None else self.train.vocab_size


def build_data(config: Config, family: str) -> DataBundle:
    """Corpus -> tokenizer -> token ids (cached) -> train/val batch sources for `family`."""
    if not isinstance(config, Config):
        raise TypeError(f"build_data expects a graphtrain.Config, got {type(config).__name__}")
    if family not in ("gpt2", "bert"):
        raise ValueError(f"family must be 'gpt2' or 'bert' (the model's .family), got {family!r}")
    data = config.data
    if source_kind(data) == "tokens":
        tok = load_user_tokenizer(data.tokenizer) if data.tokenizer is not None else None
        shards = load_token_shards(data, tok)
        common = dict(
            family=family,
            seq_len=data.seq_len,
            seed=config.train.seed,
            tokenizer=tok,
            mlm_probability=data.mlm_probability,
            vocab_size=shards.vocab_size,
        )
        return DataBundle(
            tokenizer=tok,
            train=BatchSource(shards.train, split="train", **common),
            val=BatchSource(shards.val, split="val", **common),
            info=shards.info,
        )
    tc: TokenizedCorpus = load_or_build(data)
    common = dict(
        family=family,
        seq_len=data.seq_len,
        seed=config.train.seed,
        tokenizer=tc.tokenizer,
        mlm_probability=data.mlm_probability,
    )
    info = {**tc.stats, "cache_dir": str(tc.cache_dir), "from_cache": tc.from_cache}
    return DataBundle(
        tokenizer=tc.tokenizer,
        train=BatchSource(tc.train, split="train", **common),
        val=BatchSource(tc.val, split="val", **common),
        info=info,
    )
