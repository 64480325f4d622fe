"""Test helper: a data folder as tools/preprocess_data.py writes it (MindRecord shard + manifest.json),
written directly from chosen rows so tests know every sample without a tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from mindscale.train.data.dataset import FORMAT_VERSION, MANIFEST_NAME, shard_checksums


def write_data_folder(folder: Path, rows: np.ndarray, vocab_size: int, tokenizer_sha: str = "t0") -> Path:
    """`rows` (int [samples, seq_length + 1]) as pretraining samples in one shard, with the manifest the
    loader checks (eos_id 2, pad_id 0: the config defaults; the tokenizer named only by its sha256; the shard's
    sizes and checksums)."""
    from mindspore.mindrecord import FileWriter

    samples, length = rows.shape
    folder.mkdir(parents=True)
    writer = FileWriter(str(folder / "data_00000.mindrecord"), 1, overwrite=True)
    writer.add_schema({"input_ids": {"type": "int32", "shape": [length]}}, "samples")
    writer.write_raw_data([{"input_ids": row.astype(np.int32)} for row in rows])
    writer.commit()
    manifest = {
        "format_version": FORMAT_VERSION,
        "mode": "pretrain",
        "seq_length": length - 1,
        "num_samples": samples,
        "vocab_size": vocab_size,
        "eos_id": 2,
        "pad_id": 0,
        "fields": ["input_ids"],
        "tokenizer": {"path": f"/tok/{tokenizer_sha}.model", "sha256": tokenizer_sha},
        "shards": [
            {"file": "data_00000.mindrecord", "samples": samples, **shard_checksums(folder / "data_00000.mindrecord")}
        ],
    }
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest))
    return folder
