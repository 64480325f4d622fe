"""Training a SentencePiece tokenizer with MindScale's fixed special-token ids (tools/train_tokenizer.py
runs it; docs/data.md).

Every non-blank line of the text column of every input record is one training sentence. Ids:
pad=0, unk=1, eos=2, bos=3, so pad and eos agree with the config defaults data.pad_id=0 and
data.eos_id=2. byte_fallback is on (any text encodes: unknown characters become byte pieces),
digits are split, and whitespace is kept as written (identity normalisation), as for LLaMA. The
.model and .vocab files are replaced only when training has succeeded.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from mindscale.io import DataError, sha256
from mindscale.train.data.raw_text import Source, column, read_batches

SPECIAL_IDS = {"pad_id": 0, "unk_id": 1, "eos_id": 2, "bos_id": 3}
BYTE_PIECES = 256
RESERVED_IDS = len(SPECIAL_IDS) + BYTE_PIECES  # what a vocabulary holds before its first learned piece


def sentences(sources: list[Source], text_key: str, errors: list):
    """Non-blank lines of every record; a read error is kept in `errors` (sentencepiece may wrap it)."""
    try:
        for source in sources:
            for batch in read_batches(source, text_unit="line"):
                for text in column(batch, text_key, source):
                    for line in (text or "").splitlines():
                        if line.strip():
                            yield line
    except DataError as exc:
        errors.append(exc)
        raise


def train(
    sources: list[Source],
    output: str,
    vocab_size: int,
    model_type: str = "bpe",
    text_key: str = "text",
    character_coverage: float = 0.9995,
    max_sentences: int = 2_000_000,
    user_defined_symbols: Sequence[str] = (),
    workers: int = 1,
) -> dict:
    """Train on `sources` and write OUTPUT.model and OUTPUT.vocab; returns what was written. A read error
    or sentencepiece refusing the inputs raises DataError and leaves no file behind."""
    import sentencepiece

    prefix = Path(output)
    partial = prefix.with_name(f"{prefix.name}.partial-{os.getpid()}")
    errors: list = []
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=sentences(sources, text_key, errors),
            model_prefix=str(partial),
            vocab_size=vocab_size,
            model_type=model_type,
            character_coverage=character_coverage,
            input_sentence_size=max_sentences,
            shuffle_input_sentence=True,
            byte_fallback=True,
            split_digits=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True,
            user_defined_symbols=list(user_defined_symbols),
            num_threads=workers,
            minloglevel=2,
            **SPECIAL_IDS,
        )
    except (RuntimeError, DataError) as exc:  # a read error arrives as itself or wrapped in RuntimeError
        for suffix in (".model", ".vocab"):
            Path(f"{partial}{suffix}").unlink(missing_ok=True)
        if errors:
            raise errors[0] from None
        detail = str(exc).strip().splitlines()[0]
        raise DataError(f"sentencepiece refused to train: {detail.split('] ', 1)[-1]}") from None
    os.replace(f"{partial}.vocab", f"{prefix}.vocab")
    os.replace(f"{partial}.model", f"{prefix}.model")
    processor = sentencepiece.SentencePieceProcessor(model_file=f"{prefix}.model")
    return {
        "model": f"{prefix}.model",
        "vocab": f"{prefix}.vocab",
        "vocab_size": processor.vocab_size(),
        "model_type": model_type,
        "pad_id": processor.pad_id(),
        "unk_id": processor.unk_id(),
        "eos_id": processor.eos_id(),
        "bos_id": processor.bos_id(),
        "sha256": sha256(Path(f"{prefix}.model")),
        "sources": [s.path for s in sources],
    }
