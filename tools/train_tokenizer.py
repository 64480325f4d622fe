"""Train a SentencePiece tokenizer with MindScale's fixed special-token ids.

    python tools/train_tokenizer.py --input 'corpus/*.txt' --vocab-size 2048 --output data/tokenizer

Inputs are the same kinds tools/preprocess_data.py reads (text, json/jsonl, parquet, csv files,
globs, `datasets` save_to_disk folders); every non-blank line of the --text-key column is one
training sentence. Writes PREFIX.model and PREFIX.vocab, replacing them only when training has
succeeded (and only with --overwrite).

Ids: pad=0, unk=1, eos=2, bos=3, so pad and eos agree with the config defaults data.pad_id=0 and
data.eos_id=2. byte_fallback is on (any text encodes: unknown characters become byte pieces),
digits are split, and whitespace is kept as written (identity normalisation), as for LLaMA.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from mindscale.cli import emit, fail
from mindscale.train.data import DataError, column, read_batches, resolve_sources, sha256_file

SPECIAL_IDS = {"pad_id": 0, "unk_id": 1, "eos_id": 2, "bos_id": 3}
BYTE_PIECES = 256


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", nargs="+", required=True, help="files, globs or save_to_disk folders")
    parser.add_argument("--vocab-size", type=int, required=True, help="tokens in the vocabulary")
    parser.add_argument("--output", required=True, help="prefix of the .model and .vocab files")
    parser.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    parser.add_argument("--text-key", default="text", help="column holding the text (json/parquet/csv/folders)")
    parser.add_argument("--character-coverage", type=float, default=0.9995,
                        help="fraction of characters covered by pieces; the rest fall back to bytes")
    parser.add_argument("--max-sentences", type=int, default=2_000_000,
                        help="sentences sampled for training (sentencepiece's input_sentence_size)")
    parser.add_argument("--user-defined-symbols", nargs="*", default=[],
                        help="strings kept as single tokens, e.g. LLaMA-3 chat markers")
    parser.add_argument("--workers", type=int, default=1, help="training threads")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing PREFIX.model")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    args = parser.parse_args(argv)
    minimum = len(SPECIAL_IDS) + BYTE_PIECES + 1
    if args.vocab_size < minimum:
        fail(f"--vocab-size {args.vocab_size} is too small: byte fallback alone takes "
             f"{len(SPECIAL_IDS) + BYTE_PIECES} ids; use at least {minimum} (a few hundred more in practice)")
    if args.workers < 1 or args.max_sentences < 1 or not 0 < args.character_coverage <= 1:
        fail("--workers and --max-sentences must be >= 1 and --character-coverage in (0, 1]")
    return args


def sentences(sources, text_key: str, errors: list):
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


def train(args, sources) -> dict:
    import sentencepiece

    prefix = Path(args.output)
    partial = prefix.with_name(f"{prefix.name}.partial-{os.getpid()}")
    errors: list = []
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=sentences(sources, args.text_key, errors), model_prefix=str(partial),
            vocab_size=args.vocab_size, model_type=args.model_type, character_coverage=args.character_coverage,
            input_sentence_size=args.max_sentences, shuffle_input_sentence=True, byte_fallback=True,
            split_digits=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True, user_defined_symbols=args.user_defined_symbols,
            num_threads=args.workers, minloglevel=2, **SPECIAL_IDS)
    except (RuntimeError, DataError) as exc:  # a read error arrives as itself or wrapped in RuntimeError
        for suffix in (".model", ".vocab"):
            Path(f"{partial}{suffix}").unlink(missing_ok=True)
        if errors:
            fail(str(errors[0]))
        detail = str(exc).strip().splitlines()[0]
        fail(f"sentencepiece refused to train: {detail.split('] ', 1)[-1]}")
    os.replace(f"{partial}.vocab", f"{prefix}.vocab")
    os.replace(f"{partial}.model", f"{prefix}.model")
    processor = sentencepiece.SentencePieceProcessor(model_file=f"{prefix}.model")
    return {"model": f"{prefix}.model", "vocab": f"{prefix}.vocab", "vocab_size": processor.vocab_size(),
            "model_type": args.model_type, "pad_id": processor.pad_id(), "unk_id": processor.unk_id(),
            "eos_id": processor.eos_id(), "bos_id": processor.bos_id(), "sha256": sha256_file(f"{prefix}.model"),
            "sources": [s.path for s in sources]}


def main(argv=None) -> int:
    args = parse_args(argv)
    model = Path(f"{args.output}.model")
    if model.exists() and not args.overwrite:
        fail(f"{model} exists; pass --overwrite to replace it or choose another --output")
    try:
        sources = resolve_sources(args.input)
    except DataError as exc:
        fail(str(exc))
    model.parent.mkdir(parents=True, exist_ok=True)
    result = train(args, sources)
    emit(result, args.json, f"tokenizer {result['model']}: {result['vocab_size']} tokens ({args.model_type}), "
         f"pad={result['pad_id']} unk={result['unk_id']} eos={result['eos_id']} bos={result['bos_id']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
