"""The tokenizer MindScale encodes with: a SentencePiece `.model` file, or a Hugging Face tokenizer
folder (`tokenizer.json`, read with the `tokenizers` library), behind one small interface.

Both kinds give `vocab_size` (ids are 0 .. vocab_size-1), `bos_id` / `eos_id` / `pad_id` (None when
the tokenizer has none), `encode(texts)` (plain text; no BOS/EOS added: callers place special tokens
themselves, so both kinds tokenize documents and template pieces alike), `decode(ids)` (control and
special tokens dropped), `sha256` (what a data manifest records, and what the trainer checks
data.tokenizer against) and `folder` (the Hugging Face folder, whose chat template `--template hf`
renders; None for SentencePiece).

Hugging Face special tokens are those transformers' `from_pretrained` would give: `bos_token`,
`eos_token`, `pad_token` from tokenizer_config.json, overridden by special_tokens_map.json where
that file names them; each is a string or an `{"content": ...}` object and must be a token of
tokenizer.json. Text that spells an added token of tokenizer.json (e.g. `<|eot_id|>`) becomes that
token, as in transformers; the llama3 template relies on it for its header markers.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Optional, Sequence

from mindscale.io import DataError, sha256

HF_FILE = "tokenizer.json"
HF_CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")  # later files override earlier ones
HF_FINGERPRINT_FILES = (HF_FILE, *HF_CONFIG_FILES, "chat_template.jinja")  # what changes the encoded data
SPECIAL_TOKENS = ("bos", "eos", "pad")
KINDS_HINT = "a SentencePiece .model file (tools/train_tokenizer.py) or a Hugging Face folder with tokenizer.json"


class SentencePieceTokenizer:
    """A SentencePiece .model file."""

    folder = None

    def __init__(self, path: Path, label: str):
        import sentencepiece

        try:
            self.processor = sentencepiece.SentencePieceProcessor(model_file=str(path))
        except (OSError, RuntimeError) as exc:
            raise DataError(
                f"{label} is not a SentencePiece model ({str(exc).splitlines()[0]}); point it at {KINDS_HINT}"
            ) from None
        self.path = path
        self.vocab_size = self.processor.vocab_size()
        self.bos_id, self.eos_id, self.pad_id = (
            _present(self.processor.bos_id()),
            _present(self.processor.eos_id()),
            _present(self.processor.pad_id()),
        )

    def encode(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        return self.processor.encode(list(texts), num_threads=num_threads)

    def decode(self, ids: Sequence[int]) -> str:
        return self.processor.decode(list(ids))

    @property
    def sha256(self) -> str:
        return sha256(Path(self.path))


class HFTokenizer:
    """A Hugging Face tokenizer folder: tokenizer.json plus the special tokens of its config files."""

    def __init__(self, folder: Path, label: str):
        from tokenizers import Tokenizer

        try:
            self.tokenizer = Tokenizer.from_file(str(folder / HF_FILE))
        except Exception as exc:  # the library raises plain Exception for a malformed or foreign file
            raise DataError(
                f"{label}: {HF_FILE} cannot be read by the tokenizers library "
                f"({str(exc).splitlines()[0]}); replace it with the file of the model's "
                "Hugging Face repository (tokenizer.save_pretrained writes one)"
            ) from None
        self.folder = self.path = folder
        self.vocab_size = max(self.tokenizer.get_vocab(with_added_tokens=True).values()) + 1
        tokens = special_tokens(folder, label)
        ids = {}
        for name in SPECIAL_TOKENS:
            token = tokens.get(f"{name}_token")
            ids[name] = None if token is None else self.tokenizer.token_to_id(token)
            if token is not None and ids[name] is None:
                raise DataError(
                    f"{label}: {name}_token {token!r} of its config files is not a token of {HF_FILE}; "
                    f"fix {name}_token in tokenizer_config.json / special_tokens_map.json"
                )
        self.bos_id, self.eos_id, self.pad_id = ids["bos"], ids["eos"], ids["pad"]

    def encode(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        """Token ids of each text. One thread encodes in the caller; more use the library's thread pool,
        sized by RAYON_NUM_THREADS (set from `num_threads` unless already set, before its first use)."""
        if num_threads == 1:
            return [self.tokenizer.encode(text, add_special_tokens=False).ids for text in texts]
        os.environ.setdefault("RAYON_NUM_THREADS", str(num_threads))
        return [e.ids for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    @property
    def sha256(self) -> str:
        """One digest over the folder's files that shape the ids (name and sha256 of each present one)."""
        lines = [
            f"{name} {sha256(self.folder / name)}\n" for name in HF_FINGERPRINT_FILES if (self.folder / name).is_file()
        ]
        return hashlib.sha256("".join(lines).encode()).hexdigest()


def _present(token_id: int) -> Optional[int]:
    """SentencePiece says -1 for an absent special token."""
    return token_id if token_id >= 0 else None


def _token_text(value, key: str, where: Path) -> Optional[str]:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise DataError(f"{where}: {key} must be a string or an object with a string 'content', got {value!r}; fix it")


def special_tokens(folder: Path, label: str) -> dict[str, Optional[str]]:
    """`bos_token`, `eos_token`, `pad_token` as text (absent keys are left out), in transformers' order of
    precedence: special_tokens_map.json over tokenizer_config.json."""
    tokens: dict[str, Optional[str]] = {}
    for name in HF_CONFIG_FILES:
        path = folder / name
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise DataError(f"{label}: {name} is not readable JSON ({exc}); fix or replace it") from None
        if not isinstance(data, dict):
            raise DataError(f"{label}: {name} must hold a JSON object; fix or replace it")
        for key in (f"{t}_token" for t in SPECIAL_TOKENS):
            if key in data:
                tokens[key] = _token_text(data[key], key, path)
    return tokens


def load_tokenizer(path: str | Path, flag: str = "data.tokenizer"):
    """The tokenizer at `path` (a .model file or a folder with tokenizer.json); a problem raises
    DataError naming `flag`=`path`."""
    path = Path(path)
    label = f"{flag}={path}"
    if not path.exists():
        raise DataError(f"{label} does not exist; fix the path, or train a tokenizer with tools/train_tokenizer.py")
    if path.is_dir():
        if not (path / HF_FILE).is_file():
            raise DataError(
                f"{label} is a folder without {HF_FILE}; point it at {KINDS_HINT} "
                "(a Hugging Face folder with only tokenizer.model: point at that file)"
            )
        return HFTokenizer(path, label)
    return SentencePieceTokenizer(path, label)
