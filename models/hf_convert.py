"""Hugging Face <-> MindScale weights and configs, run from each architecture's adapter (the
`hf` of its entry in models/archs/: its tensor table and its config.json mapping).

Every conversion is a pure re-arrangement (rename, transpose, split, concatenate) so a round trip
reproduces the original tensors bit for bit.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from mindscale.io import CheckpointError
from models.archs import ARCHS
from models.spec import HFAdapter, HFUnsupported, Rule
from models.tensor_file import full_index, open_tensors


class HFConversionError(CheckpointError):
    """The Hugging Face checkpoint cannot be converted. One line; the CLIs exit 2."""


CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
GENERATION_CONFIG = "generation_config.json"  # generate()'s defaults: special-token ids, sampling
# A tokenizer's files in a Hugging Face folder (SentencePiece, tokenizers' JSON, GPT-2's BPE, the chat template).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
PARTIAL = ".partial-"

# HF tensors that are buffers, not weights (older checkpoints store them).
IGNORED_HF = re.compile(r"(rotary_emb\.inv_freq|\.attn\.bias|\.attn\.masked_bias)$")


# ---------------------------------------------------------------------------------------------
# Configs


def model_config_from_hf(hf_config: dict) -> dict:
    """MindScale `model:` keys from a Hugging Face config.json, by the adapter of its model_type."""
    kind = hf_config.get("model_type")
    spec = next((s for s in ARCHS.values() if s.hf.model_type == kind), None)
    if spec is None:
        known = ", ".join(s.hf.model_type for s in ARCHS.values())
        raise HFConversionError(f"model_type={kind!r} is not supported; convert a checkpoint of {known}")
    try:
        return spec.hf.config_from_hf(hf_config)
    except KeyError as exc:
        raise HFConversionError(f"config.json lacks {exc.args[0]!r}; it is not a complete {kind} config")
    except HFUnsupported as exc:
        raise HFConversionError(str(exc))


def model_config_differences(hf_model: dict, m) -> list[str]:
    """Keys where the HF model (model_config_from_hf) and ModelConfig `m` disagree, as `key=theirs (ours)`.
    With rotary positions max_position_embeddings is a limit, not the training length, so seq_length is
    then not compared. Another family is one difference, naming both (a mixture of experts into a dense
    config: its experts would have nowhere to go)."""
    if hf_model["arch"] != m.arch:
        kind = {True: "a mixture of experts", False: "dense"}
        return [
            f"model.arch={hf_model['arch']!r}, {kind[ARCHS[hf_model['arch']].moe]} (config has {m.arch!r}, "
            f"{kind[m.spec.moe]})"
        ]
    hf_model = dict(hf_model)
    sections = {name: hf_model.pop(name) for name in ("moe", "mla") if name in hf_model}
    if m.mtp_depth <= hf_model.get("mtp_depth", 0):  # fewer multi-token-prediction modules: the rest unread
        hf_model.pop("mtp_depth", None)
    ours = {key: getattr(m, key) for key in hf_model}
    ours["num_kv_heads"] = m.kv_heads
    if "head_dim" in hf_model:
        ours["head_dim"] = m.head_size
        hf_model = hf_model | {"head_dim": hf_model["head_dim"] or hf_model["hidden_size"] // hf_model["num_heads"]}
    skip = set() if ARCHS[hf_model["arch"]].learned_positions else {"seq_length"}
    return [
        f"model.{key}={hf_model[key]!r} (config has {ours[key]!r})"
        for key in hf_model
        if key not in skip and hf_model[key] != ours[key]
    ] + [
        f"model.{name}.{key}={value!r} (config has {getattr(getattr(m, name), key)!r})"
        for name, section in sections.items()
        for key, value in section.items()
        if value != getattr(getattr(m, name), key)
    ]


def hf_config_from_model(m) -> dict:
    """A transformers config.json for MindScale model config `m` (mindscale.config.ModelConfig)."""
    try:
        return ARCHS[m.arch].hf.config_to_hf(m)
    except HFUnsupported as exc:
        raise HFConversionError(str(exc))


def carried_from_source(source: dict, m) -> dict:
    """What an export's config.json keeps of the config.json of the model a run started from (`source`):
    its special-token ids, and with rotary positions its max_position_embeddings, the context the model
    was made for, which a shorter training length (model.seq_length) does not change."""
    keys = {key: source[key] for key in TOKEN_ID_KEYS if source.get(key) is not None}
    if not ARCHS[m.arch].learned_positions and isinstance(source.get("max_position_embeddings"), int):
        keys["max_position_embeddings"] = max(source["max_position_embeddings"], m.seq_length)
    return keys


# ---------------------------------------------------------------------------------------------
# Weights


def _expand(adapter: HFAdapter, model: dict) -> list[Rule]:
    """The adapter's rules for every layer of the model whose `model:` keys are `model` (nested sections as
    dicts), those its `applies` keeps; `{e}` stays for _experts."""
    rules = []
    for rule in adapter.table:
        if model["tie_embeddings"] and rule.ours == "output.weight":
            continue
        layers = range(model["num_layers"]) if "{i}" in rule.ours else [None]
        rules += [
            Rule(rule.ours.format(i=i), rule.theirs.replace("{i}", str(i)), rule.transpose, rule.part)
            for i in layers
            if adapter.applies is None or adapter.applies(model, rule, i)
        ]
    return rules + _mtp_rules(adapter, model)


def _mtp_rules(adapter: HFAdapter, model: dict) -> list[Rule]:
    """The rules of the model's model["mtp_depth"] multi-token-prediction modules (models/mtp.py): module k is
    stored as decoder layer L + k, its block by the table's layer rules, the rest by the adapter's mtp_table."""
    rules = []
    for k in range(model.get("mtp_depth", 0)):
        i = model["num_layers"] + k
        for rule in adapter.table:
            if rule.ours.startswith("layers.{i}.") and (adapter.applies is None or adapter.applies(model, rule, i)):
                ours = f"mtp.{k}.block." + rule.ours[len("layers.{i}.") :]
                rules.append(Rule(ours, rule.theirs.replace("{i}", str(i)), rule.transpose, rule.part))
        rules += [Rule(r.ours.format(k=k), r.theirs.format(i=i), r.transpose, r.part) for r in adapter.mtp_table]
    return rules


def _mtp_shared(adapter: HFAdapter, model: dict) -> dict[str, str]:
    """HF name -> MindScale name of the copies of the shared embedding and head each module stores."""
    shared = {}
    for k in range(model.get("mtp_depth", 0)):
        for rule in adapter.mtp_shared:
            ours = "tok_embeddings.weight" if model["tie_embeddings"] and rule.ours == "output.weight" else rule.ours
            shared[rule.theirs.format(i=model["num_layers"] + k)] = ours
    return shared


def _unread_modules(model: dict, stored: int) -> re.Pattern | None:
    """The layers of the stored multi-token-prediction modules the model does not build (model["mtp_depth"] of
    `stored`), ignored on import."""
    layers = [str(model["num_layers"] + k) for k in range(model.get("mtp_depth", 0), stored)]
    return re.compile(rf"^model\.layers\.({'|'.join(layers)})\.") if layers else None


def _experts(rule: Rule, num_experts: int) -> list[Rule]:
    """Rule `rule` per expert (one rule if it is not per expert)."""
    if not rule.per_expert:
        return [rule]
    return [Rule(rule.ours, rule.theirs.replace("{e}", str(e)), rule.transpose, rule.part) for e in range(num_experts)]


class StackedView:
    """MindScale tensor [E, ...] as the stack of E expert views (RuleViews): `[index]` reads only the
    experts (and the slice of each) that the index selects, so an expert-parallel rank reads its own."""

    def __init__(self, views: list):
        self.views = views
        self.shape = (len(views), *views[0].shape)

    def __getitem__(self, index) -> np.ndarray:
        index = full_index(index, self.shape)
        experts = range(index[0].start, index[0].stop) if isinstance(index[0], slice) else index[0]
        return np.stack([self.views[e][index[1:]] for e in experts])


def _add_prefix(hf_state: dict, prefix: str) -> dict:
    """Checkpoints of some families exist with and without a prefix (GPT-2's `transformer.`); use the
    prefixed names."""
    if not prefix or any(k.startswith(prefix) for k in hf_state):
        return hf_state
    return {(k if k.startswith("lm_head.") else prefix + k): v for k, v in hf_state.items()}


class RuleView:
    """MindScale tensor `rule.ours` as a view of HF tensor `theirs` (an array or a lazy StoredTensor):
    its `shape`, and `[index]` reads that part alone, the index mapped through the row split and the
    transpose. A sharded rank reads its slice of a fused or transposed HF tensor without the rest."""

    def __init__(self, rule: Rule, theirs):
        self.rule, self.theirs = rule, theirs
        shape = tuple(theirs.shape)[::-1] if rule.transpose else tuple(theirs.shape)
        self.shape = (shape[0] // rule.part[1], *shape[1:]) if rule.part else shape

    def __getitem__(self, index) -> np.ndarray:
        index = list(full_index(index, self.shape))
        if self.rule.part:  # row block part[0] of the (transposed) HF tensor
            offset = self.rule.part[0] * self.shape[0]
            index[0] = slice(index[0].start + offset, index[0].stop + offset)
        if self.rule.transpose:
            return np.ascontiguousarray(np.asarray(self.theirs[tuple(index[::-1])]).T)
        return np.ascontiguousarray(self.theirs[tuple(index)])


def hf_views(hf_state: dict, hf_config: dict, mtp_depth: int | None = None) -> tuple[dict, dict[str, RuleView]]:
    """(MindScale model-config dict, MindScale weights as RuleViews: nothing read yet) from HF tensors
    (arrays or StoredTensors) and config.json contents. `mtp_depth`: read the first that many of the stored
    multi-token-prediction modules (None: all; their stored copies of the shared embedding and head are never
    read: the model's own are)."""
    model = model_config_from_hf(hf_config)
    adapter = ARCHS[model["arch"]].hf
    stored = model.get("mtp_depth", 0)
    if mtp_depth is not None and mtp_depth > stored:
        raise HFConversionError(
            f"model.mtp_depth={mtp_depth} but the checkpoint stores {stored} multi-token-prediction modules "
            f"(num_nextn_predict_layers); set model.mtp_depth to at most {stored}"
        )
    if stored:
        model["mtp_depth"] = stored if mtp_depth is None else mtp_depth
    unread = _unread_modules(model, stored)
    shared = _mtp_shared(adapter, model)
    state = {
        k: v
        for k, v in _add_prefix(hf_state, adapter.unprefixed).items()
        if not IGNORED_HF.search(k) and not (unread and unread.match(k)) and k not in shared
    }
    rules = _expand(adapter, model)
    experts = model.get("moe", {}).get("num_experts", 0)
    needed = {each.theirs for r in rules for each in _experts(r, experts)}
    missing = sorted(needed - set(state))
    unused = sorted(set(state) - needed - ({"lm_head.weight"} if model["tie_embeddings"] else set()))
    if missing or unused:
        parts = ([f"missing {len(missing)}: {', '.join(missing[:3])}"] if missing else []) + (
            [f"unexpected {len(unused)}: {', '.join(unused[:3])}"] if unused else []
        )
        raise HFConversionError(f"Hugging Face tensors do not match config.json ({'; '.join(parts)})")
    return model, {
        r.ours: StackedView([RuleView(each, state[each.theirs]) for each in _experts(r, experts)])
        if r.per_expert
        else RuleView(r, state[r.theirs])
        for r in rules
    }


def hf_to_mindscale(
    hf_state: dict, hf_config: dict, mtp_depth: int | None = None
) -> tuple[dict, dict[str, np.ndarray]]:
    """(MindScale model-config dict, MindScale weights) from HF tensors and config.json contents; `mtp_depth` as
    hf_views takes it."""
    model, views = hf_views(hf_state, hf_config, mtp_depth)
    return model, {name: view[...] for name, view in views.items()}


def mindscale_to_hf(weights: dict[str, np.ndarray], m) -> tuple[dict[str, np.ndarray], dict]:
    """(HF tensors, config.json contents) from MindScale weights and model config `m`."""
    model = dataclasses.asdict(m)
    rules = _expand(ARCHS[m.arch].hf, model)
    missing = [r.ours for r in rules if r.ours not in weights]
    if missing:
        raise HFConversionError(
            f"MindScale weights lack {len(missing)} tensors (first: {', '.join(missing[:3])}); "
            "the checkpoint does not match the config"
        )
    grouped: dict[str, list[Rule]] = {}
    state = {}
    for r in rules:
        if r.per_expert:
            for e, each in enumerate(_experts(r, m.moe.num_experts)):
                state[each.theirs] = np.ascontiguousarray(weights[r.ours][e].T if r.transpose else weights[r.ours][e])
        else:
            grouped.setdefault(r.theirs, []).append(r)
    for theirs, group in grouped.items():
        group = sorted(group, key=lambda r: r.part[0] if r.part else 0)
        value = np.concatenate([weights[r.ours] for r in group], axis=0) if len(group) > 1 else weights[group[0].ours]
        state[theirs] = np.ascontiguousarray(value.T if group[0].transpose else value)
    for theirs, ours in _mtp_shared(ARCHS[m.arch].hf, model).items():
        state[theirs] = state[next(r.theirs for r in rules if r.ours == ours)]
    return state, hf_config_from_model(m)


# ---------------------------------------------------------------------------------------------
# Files


def is_hf_folder(path: str | Path) -> bool:
    path = Path(path)
    return path.is_dir() and (path / CONFIG_FILE).is_file()


def read_hf_config(path: str | Path) -> dict:
    """The config.json of a Hugging Face model folder."""
    path = Path(path)
    if not is_hf_folder(path):
        raise HFConversionError(f"{path} is not a Hugging Face model folder (no {CONFIG_FILE})")
    try:
        return json.loads((path / CONFIG_FILE).read_text())
    except json.JSONDecodeError as exc:
        raise HFConversionError(f"{path / CONFIG_FILE} is not valid JSON ({exc.msg})")


def read_hf_folder(path: str | Path, lazy: bool = False) -> tuple[dict, dict]:
    """(tensors, config) of a Hugging Face model folder: config.json + model.safetensors, else the
    shards listed in model.safetensors.index.json (transformers' order: an export written beside an
    older sharded checkpoint is what both read). BF16 widens to fp32. `lazy`: the tensors are
    StoredTensors (models/tensor_file.py), read only where indexed."""
    path = Path(path)
    config = read_hf_config(path)
    index = path / "model.safetensors.index.json"
    if (path / WEIGHTS_FILE).is_file():
        files = [WEIGHTS_FILE]
    elif index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        raise HFConversionError(
            f"{path} has no model.safetensors or model.safetensors.index.json "
            "(PyTorch .bin checkpoints are not read; re-save with safetensors)"
        )
    tensors = {}
    for name in files:
        if not (path / name).is_file():
            raise HFConversionError(f"{path / name} listed in the index is missing")
        tensors.update(open_tensors(path / name))
    return (tensors if lazy else {name: t[...] for name, t in tensors.items()}), config


def check_export_folder(path: str | Path, overwrite: bool) -> None:
    """Refuse an export folder that is a file, or that holds files unless `overwrite` (then the export
    replaces its own files there and leaves every other one)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise HFConversionError(f"--output {path} is a file; pass a folder path")
    others = sorted(p.name for p in path.iterdir() if not _partial_of_ours(p.name)) if path.is_dir() else []
    if others and not overwrite:
        raise HFConversionError(
            f"--output {path} is not empty ({_names(others)}); pass --overwrite to replace the "
            "files the export writes there and keep the others, or choose another folder"
        )


def write_hf_folder(
    path: str | Path,
    hf_state: dict[str, np.ndarray],
    hf_config: dict,
    files: dict[str, bytes] | None = None,
    overwrite: bool = False,
) -> Path:
    """config.json + model.safetensors that transformers' from_pretrained loads, and `files` (name ->
    contents: a tokenizer, a generation config), into folder `path`: absent or empty, or any folder with
    `overwrite` (check_export_folder). Only these files are written and no other is removed. Each is
    written whole under a temporary name beside its own, then all are renamed into place, config.json
    last: a kill leaves every file whole, and a new folder becomes a Hugging Face folder (config.json)
    only when it is complete."""
    path = Path(path)
    check_export_folder(path, overwrite)
    path.mkdir(parents=True, exist_ok=True)
    for stale in path.iterdir():  # of an export killed before its renames
        if _partial_of_ours(stale.name):
            stale.unlink()
    writers = {name: (lambda target, data=data: target.write_bytes(data)) for name, data in (files or {}).items()}
    writers[WEIGHTS_FILE] = lambda target: save_file(
        {k: np.ascontiguousarray(v) for k, v in hf_state.items()}, str(target), metadata={"format": "pt"}
    )
    writers[CONFIG_FILE] = lambda target: target.write_text(json.dumps(hf_config, indent=2) + "\n")
    partials = {name: path / f".{name}{PARTIAL}{os.getpid()}" for name in writers}
    try:
        for name, write in writers.items():
            write(partials[name])
            _fsync(partials[name])
        for name, partial in partials.items():  # dicts keep their order: config.json last
            os.replace(partial, path / name)
    finally:
        for partial in partials.values():
            partial.unlink(missing_ok=True)
    return path


def _partial_of_ours(name: str) -> bool:
    """Whether `name` is a file an export writes before renaming it into place (`.config.json.partial-<pid>`)."""
    return name.startswith(".") and PARTIAL in name


def _names(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _fsync(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())
