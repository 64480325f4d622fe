"""Train a SentencePiece tokenizer with MindScale's fixed special-token ids.

    python tools/train_tokenizer.py --input 'corpus/*.txt' --vocab-size 2048 --output data/tokenizer

Inputs are the same kinds tools/preprocess_data.py reads (text, json/jsonl, parquet, csv files,
globs, `datasets` save_to_disk folders); every non-blank line of the --text-key column is one
training sentence. Writes PREFIX.model and PREFIX.vocab, replacing them only when training has
succeeded (and only with --overwrite).

Ids: pad=0, unk=1, eos=2, bos=3, so pad and eos agree with the config defaults data.pad_id=0 and
data.eos_id=2. byte_fallback is on (any text encodes: unknown characters become byte pieces),
digits are split, and whitespace is kept as written (identity normalisation), as for LLaMA.
The training is mindscale/train/data/tokenizer_training.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mindscale.cli import emit, fail
from mindscale.config import UserError
from mindscale.train.data.raw_text import resolve_sources
from mindscale.train.data.tokenizer_training import RESERVED_IDS, train


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", nargs="+", required=True, help="files, globs or save_to_disk folders")
    parser.add_argument("--vocab-size", type=int, required=True, help="tokens in the vocabulary")
    parser.add_argument("--output", required=True, help="prefix of the .model and .vocab files")
    parser.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    parser.add_argument("--text-key", default="text", help="column holding the text (json/parquet/csv/folders)")
    parser.add_argument(
        "--character-coverage",
        type=float,
        default=0.9995,
        help="fraction of characters covered by pieces; the rest fall back to bytes",
    )
    parser.add_argument(
        "--max-sentences",
        type=int,
        default=2_000_000,
        help="sentences sampled for training (sentencepiece's input_sentence_size)",
    )
    parser.add_argument(
        "--user-defined-symbols", nargs="*", default=[], help="strings kept as single tokens, e.g. LLaMA-3 chat markers"
    )
    parser.add_argument("--workers", type=int, default=1, help="training threads")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing PREFIX.model")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    args = parser.parse_args(argv)
    if args.vocab_size <= RESERVED_IDS:
        fail(
            f"--vocab-size {args.vocab_size} is too small: byte fallback alone takes "
            f"{RESERVED_IDS} ids; use at least {RESERVED_IDS + 1} (a few hundred more in practice)"
        )
    if args.workers < 1 or args.max_sentences < 1 or not 0 < args.character_coverage <= 1:
        fail("--workers and --max-sentences must be >= 1 and --character-coverage in (0, 1]")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    model = Path(f"{args.output}.model")
    if model.exists() and not args.overwrite:
        fail(f"{model} exists; pass --overwrite to replace it or choose another --output")
    try:
        sources = resolve_sources(args.input)
        model.parent.mkdir(parents=True, exist_ok=True)
        result = train(
            sources,
            args.output,
            args.vocab_size,
            args.model_type,
            args.text_key,
            args.character_coverage,
            args.max_sentences,
            args.user_defined_symbols,
            args.workers,
        )
    except UserError as exc:  # every error a user can fix: one line, exit 2
        fail(str(exc))
    emit(
        result,
        args.json,
        f"tokenizer {result['model']}: {result['vocab_size']} tokens ({args.model_type}), "
        f"pad={result['pad_id']} unk={result['unk_id']} eos={result['eos_id']} bos={result['bos_id']}",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
