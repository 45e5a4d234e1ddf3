"""The sampled vocabulary: its geometry padded for the kernels, and ids no tokenizer can spell masked.

Two facts of checkpoints as they ship meet here:

  * the GPU kernels read vocabulary-wide rows in tiles that assume widths that are multiples of
    ALIGNMENT (16; ignition/gpu_kernels/specs.py), but a vocabulary may have any size;
  * a checkpoint's `vocab_size` may exceed its tokenizer (Qwen2.5: 151,936 embedding rows for
    151,665 tokenizer ids): the extra rows are padding that no text spells.

So preparation gives every recipe's source a vocabulary padded to the kernels' multiple (zero
rows appended to the embedding table and the head, when a kernel library is used: a core for
the numpy and CPU executors keeps its exact width), and every program adds -inf to the logits
of ids at or past the tokenizer's size right after the forward pass, before anything reads them
(sampling, logprobs, penalties), by the existing `sampling.logit_bias.v1` kernel reading a
constant (ids, -inf) table stored with the weights. Such ids are never sampled or emitted.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from ignition.gpu_kernels.specs import ALIGNMENT
from ignition.preparation.contract import StepIO, TextCapacities
from ignition.recorder import Recorder

VOCABULARY_MULTIPLE = ALIGNMENT
MASK_IDS = "weights.vocabulary_mask.ids"        # i32 [logit rows, masked ids]
MASK_VALUES = "weights.vocabulary_mask.values"  # f32 [logit rows, masked ids], all -inf
# the tensors whose rows are vocabulary ids (GGUF names, as sources and the decoder use them)
VOCABULARY_TENSORS = ("token_embd.weight", "output.weight")


def padded_width(vocab: int, multiple: int) -> int:
    return -(-vocab // multiple) * multiple


class PaddedVocabularySource:
    """A recipe's source whose vocabulary has `width` rows: the embedding table and the head
    gain zero rows (their own blocks are then not used: the padded matrix is dequantized)."""

    def __init__(self, source: Any, width: int) -> None:
        self._source = source
        self.shape = replace(source.shape, vocab=width, tokenizer_tokens=spelled_tokens(source.shape))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._source, name)

    def tensor(self, name: str) -> np.ndarray:
        array = self._source.tensor(name)
        if name not in VOCABULARY_TENSORS or array.shape[0] == self.shape.vocab:
            return array
        padding = np.zeros((self.shape.vocab - array.shape[0],) + array.shape[1:], dtype=array.dtype)
        return np.concatenate([array, padding])

    def blocks(self, name: str) -> Any:
        own = getattr(self._source, "blocks", None)
        if own is None or name in VOCABULARY_TENSORS:
            return None
        return own(name)


def with_kernel_geometry(source: Any, multiple: int) -> Any:
    """`source`, or a PaddedVocabularySource when its vocabulary is not a multiple of `multiple`."""
    width = padded_width(source.shape.vocab, multiple)
    return source if width == source.shape.vocab else PaddedVocabularySource(source, width)


def spelled_tokens(shape: Any) -> int:
    """Ids the tokenizer can spell: the source's tokenizer size, else the whole vocabulary."""
    return int(getattr(shape, "tokenizer_tokens", 0) or shape.vocab)


def mask_tensors(logit_rows: int, first_masked: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids, values) of the vocabulary mask: every logits row masks ids [first_masked, vocab)."""
    ids = np.tile(np.arange(first_masked, vocab, dtype=np.int32), (logit_rows, 1))
    return ids, np.full(ids.shape, -np.inf, dtype=np.float32)


def record_mask(rec: Recorder, cap: TextCapacities, io: StepIO) -> None:
    """After the forward pass: -inf on the logits of every id past the tokenizer (none: no node)."""
    if cap.masked_tokens:
        rec.launch("sampling.logit_bias.v1", "logits.vocabulary_mask", logits=io.logits, bias_ids=MASK_IDS,
                   bias_values=MASK_VALUES, rows=io.rows, vocab=cap.vocab, bias_capacity=cap.masked_tokens)
