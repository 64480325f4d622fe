"""The raw inputs tools/train_tokenizer.py and tools/preprocess_data.py read: files, globs and `datasets`
save_to_disk folders (`resolve_sources`), read through the `datasets` library in record batches
(`read_batches`). docs/data.md, "Inputs", lists the formats.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from mindscale.io import DataError

SOURCE_FORMATS = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".py": "text",
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
    ".csv": "csv",
}
COMPRESSION_SUFFIXES = (".gz", ".bz2", ".xz", ".zst")
GLOB_CHARS = set("*?[")
READ_BLOCK = 1 << 20  # text/json: bytes `datasets` reads and parses at a time; records are the same for any size


@dataclass(frozen=True)
class Source:
    path: str
    format: str  # text | json | parquet | csv | disk (a `datasets` save_to_disk folder)


def _source_format(path: Path) -> str:
    if path.is_dir():
        if any((path / name).is_file() for name in ("state.json", "dataset_dict.json")):
            return "disk"
        raise DataError(
            f"input {path} is a folder but not a `datasets` save_to_disk folder; pass files or a "
            f"glob such as '{path}/*.jsonl'"
        )
    suffixes = [s for s in path.suffixes if s not in COMPRESSION_SUFFIXES]
    fmt = SOURCE_FORMATS.get(suffixes[-1].lower() if suffixes else "")
    if fmt is None:
        raise DataError(
            f"input {path}: unknown format; use {'/'.join(sorted(SOURCE_FORMATS))} files "
            "(optionally compressed) or a save_to_disk folder"
        )
    return fmt


def resolve_sources(patterns: list[str]) -> list[Source]:
    """Files, globs (sorted) and save_to_disk folders, in the order given; missing or empty ones are errors."""
    import glob

    sources = []
    for pattern in patterns:
        paths = sorted(glob.glob(pattern, recursive=True)) if GLOB_CHARS & set(pattern) else [pattern]
        if not paths:
            raise DataError(f"input {pattern!r} matches no file; check the pattern (quote it for the shell)")
        for name in paths:
            path = Path(name)
            if not path.exists():
                raise DataError(f"input {path} does not exist; pass existing files, globs or save_to_disk folders")
            if path.is_file() and path.stat().st_size == 0:
                raise DataError(f"input {path} is empty; remove it from --input")
            if path.is_dir() and GLOB_CHARS & set(pattern):
                continue  # a glob like data/** also yields folders; their files are matched themselves
            sources.append(Source(str(path.resolve()), _source_format(path)))
    if not sources:
        raise DataError(f"inputs {patterns} hold no files; pass text, json/jsonl, parquet or csv files")
    return sources


def _quiet_datasets():
    """`datasets` configured for local files only, with no progress bars or log lines on stderr."""
    import logging
    import os

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(logging.CRITICAL)
    return datasets


def _open_source(source: Source, text_unit: str):
    datasets = _quiet_datasets()
    if source.format != "disk":
        options = {"sample_by": text_unit} if source.format == "text" else {}
        if source.format in ("text", "json"):  # bytes parsed at a time (the builders' default is 10 MiB)
            options["chunksize"] = READ_BLOCK
        return datasets.load_dataset(source.format, data_files=[source.path], split="train", streaming=True, **options)
    loaded = datasets.load_from_disk(source.path)
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise DataError(
                f"input {source.path} holds splits {sorted(loaded)} but no 'train' split; "
                "save the split to use with Dataset.save_to_disk"
            )
        loaded = loaded["train"]
    return loaded


def read_batches(source: Source, text_unit: str = "document", batch_size: int = 1024) -> Iterator[dict]:
    """Columns of `batch_size` records at a time; unreadable files raise DataError naming the file.

    text_unit (text files): 'document' = a whole file is one document, 'paragraph' = blank-line
    separated blocks, 'line' = every line.
    """
    try:
        iterator = iter(_open_source(source, text_unit).iter(batch_size=batch_size))
    except DataError:
        raise
    except Exception as exc:  # whatever pyarrow, pandas or datasets raise on a corrupt file
        raise _read_error(source, exc) from None
    while True:
        try:
            batch = next(iterator)
        except StopIteration:
            return
        except Exception as exc:
            raise _read_error(source, exc) from None
        yield batch


def _read_error(source: Source, exc: Exception) -> DataError:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return DataError(f"cannot read {source.path} as {source.format} ({text[:200]}); fix or remove the file")


def column(batch: dict, key: str, source: Source) -> list:
    if key not in batch:
        raise DataError(f"{source.path} has no column {key!r} (columns: {sorted(batch)}); pass --text-key")
    return batch[key]
