"""Weights into models: one module for reading checkpoints' tensors, checking them against a model
and copying them in (`assign`), whole or as one rank's slice.

A rank's slice comes from its compiled layout (an entry of `Cell.parameter_layout_dict`). After a sharded graph compiles, MindSpore gives each parameter (dev_matrix, tensor_map, slice_shape,
field_size, uniform_split, opt_shard_group, full_shape, ...). Dimension d of the tensor is split
tensor_map[d] >= 0 ways along device-matrix axis (len(dev_matrix) - 1 - tensor_map[d]) (-1: whole);
a rank's coordinate in the device matrix is its index read row-major (the last axis fastest), so
the ranks of every pipeline stage map alike. With the optimizer shard (opt_shard_group set) the
first dimension of that slice is cut again among the ranks that hold it (the device-matrix axes the
tensor map does not use), in rank order. MindSpore's own loader (mindspore.parallel._tensor) slices
a full tensor the same way; this gives the index ranges instead, so a reader takes only its slice.
A pipeline stage's graph holds only its own parameters (`held`: what a rank loads, saves and
resumes), so full weights are checked against the whole model and read only where a rank holds them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from mindspore import nn

from mindscale.config import Config, ConfigError, config_from_tree
from mindscale.io import CheckpointError, read_tensors, verify_folder
from models.archs import ARCHS
from models.hf_convert import (
    HFConversionError,
    hf_views,
    is_hf_folder,
    model_config_differences,
    model_config_from_hf,
    read_hf_config,
    read_hf_folder,
)
from models.mf_convert import is_mindformers_checkpoint, mf_views, read_mindformers
from models.tensor_file import extent, full_index, open_tensors
from models.lora import is_adapter, merge, split_adapters, without_lora

WEIGHTS = "model.safetensors"  # a checkpoint folder's weights file


def _coordinate(rank: int, dev_matrix: list[int]) -> list[int]:
    coordinate = [0] * len(dev_matrix)
    for axis in reversed(range(len(dev_matrix))):
        coordinate[axis] = rank % dev_matrix[axis]
        rank //= dev_matrix[axis]
    return coordinate


def _axes_per_dimension(tensor_map: list, full_shape: list, slice_shape, dev_matrix: list) -> list[tuple]:
    """The tensor map's device-axis indices per tensor dimension, major first. MindSpore lists a dimension split over
    several axes as one entry per axis, the first the most significant (its _expand_layout): 2D tensor parallel's
    1-D norm weights split ("x", "y"), 3D tensor parallel's projection weights [out, in] split (y, (x, z)) as
    [2, 0, 1]. Which entries belong to which dimension follows from the slice shape, from the last dimension back:
    each takes the fewest trailing entries whose device axes multiply to the parts it is cut into, and the first
    dimension the entries left (the optimizer shard may cut it further, so its slice does not tell). A nested map
    is taken as it is."""
    ndim = len(full_shape)
    if len(tensor_map) == ndim:
        return [tuple(k) if isinstance(k, (list, tuple)) else (k,) for k in tensor_map]
    if ndim == 1:
        return [tuple(tensor_map)]
    if slice_shape is None or len(slice_shape) != ndim:
        raise ValueError(f"tensor map {tensor_map} of a {ndim}-D tensor needs its slice shape to group; not given")
    ways = [dev_matrix[len(dev_matrix) - 1 - k] if k >= 0 else 1 for k in tensor_map]
    groups, end = [], len(tensor_map)
    for dim in range(ndim - 1, 0, -1):
        parts, start = full_shape[dim] // slice_shape[dim], end - 1
        while start > dim and math.prod(ways[start:end]) < parts:
            start -= 1
        if math.prod(ways[start:end]) != parts:
            raise ValueError(f"tensor map {tensor_map} does not split {full_shape} into slices {slice_shape}")
        groups.insert(0, tuple(tensor_map[start:end]))
        end = start
    return [tuple(tensor_map[:end]), *groups]


def local_slice(layout: tuple, rank: int) -> tuple[slice, ...]:
    """Index ranges of `rank`'s slice of the full tensor, per dimension. A dimension split over several device
    axes is cut into their product of blocks, the first axis the most significant."""
    dev_matrix, tensor_map, full_shape, opt_group = list(layout[0]), list(layout[1]), list(layout[6]), layout[5]
    coordinate = _coordinate(rank, dev_matrix)
    used, index = [], []
    slice_shape = list(layout[2]) if layout[2] is not None else None
    for size, keys in zip(full_shape, _axes_per_dimension(tensor_map, full_shape, slice_shape, dev_matrix)):
        parts, at = 1, 0
        for axis in (len(dev_matrix) - 1 - k for k in keys if k >= 0):
            parts, at = parts * dev_matrix[axis], at * dev_matrix[axis] + coordinate[axis]
            used.append(axis)
        step = size // parts
        index.append(slice(at * step, (at + 1) * step))
    if opt_group and index:
        free = [axis for axis in range(len(dev_matrix)) if axis not in used]
        holders = math.prod(dev_matrix[axis] for axis in free)
        at = 0
        for axis in free:  # this rank's place among the ranks holding the same slice, in rank order
            at = at * dev_matrix[axis] + coordinate[axis]
        first = index[0]
        step = (first.stop - first.start) // holders
        index[0] = slice(first.start + at * step, first.start + (at + 1) * step)
    return tuple(index)


def saved_layout(layout: tuple) -> list:
    """A compiled layout as state.json keeps it (its first 7 fields, lists for tuples); local_slice reads it back."""
    return [list(x) if isinstance(x, (list, tuple)) else x for x in layout[:7]]


def take_slice(full: np.ndarray, layout: tuple | None, rank: int) -> np.ndarray:
    """`full` as `rank` holds it (the whole tensor when the parameter has no layout: not sharded)."""
    if layout is None or not layout[1]:
        return full
    return np.ascontiguousarray(full.reshape(layout[6])[local_slice(layout, rank)])


class Merged:
    """The full tensor `name` as ranks' slices, each (rank, its compiled layout, its slice: an array or a
    lazy tensor) where local_slice puts it, nothing read yet: the inverse of take_slice over the ranks
    that hold it. `[index]` reads from each slice only its part of `index`, from one of equal replicas.
    A part of the tensor no slice covers (a rank's folder missing) is an error when it is read."""

    def __init__(self, name: str, parts: list[tuple[int, tuple | None, object]]):
        self.name, (_, layout, piece) = name, parts[0]
        if layout is None or not layout[1]:  # not sharded: every part is the whole tensor
            self.shape, self.slices = tuple(piece.shape), [(full_index(Ellipsis, piece.shape), piece)]
            return
        self.shape, self.slices, seen = tuple(layout[6]), [], set()
        for rank, layout, piece in parts:
            where = local_slice(layout, rank)
            key = tuple((s.start, s.stop) for s in where)  # slices are not hashable
            if key not in seen:
                seen.add(key)
                self.slices.append((where, piece))

    def __getitem__(self, index) -> np.ndarray:
        index = full_index(index, self.shape)
        part, covered = None, np.zeros(tuple(extent(s) for s in index), bool)
        for where, piece in self.slices:
            overlap = _overlap(index, where)
            if overlap is None:
                continue
            into, within = overlap
            shape = tuple(s.stop - s.start for s in where)
            value = (piece if tuple(piece.shape) == shape else np.reshape(piece[...], shape))[within]
            if part is None:
                part = np.empty(covered.shape, value.dtype)
            part[into] = value
            covered[into] = True
        if part is None or not covered.all():
            raise CheckpointError(
                f"{self.name}: the ranks' slices cover {covered.mean():.0%} of the part read; "
                "a rank's checkpoint part is missing"
            )
        return part


def _overlap(index: tuple, where: tuple[slice, ...]) -> tuple[tuple, tuple] | None:
    """Where slice `where` of a tensor meets `index`: (positions in the part read, in the slice), or None."""
    into, within = [], []
    for s, w in zip(index, where):
        if isinstance(s, slice):
            low, high = max(s.start, w.start), min(s.stop, w.stop)
            if low >= high:
                return None
            into.append(slice(low - s.start, high - s.start))
            within.append(slice(low - w.start, high - w.start))
        else:
            hits = np.flatnonzero((s >= w.start) & (s < w.stop))
            if not hits.size:
                return None
            into.append(hits)
            within.append(s[hits] - w.start)
    return tuple(into), tuple(within)


def merge_slices(name: str, parts: list[tuple[int, tuple | None, np.ndarray]]) -> np.ndarray:
    """The full tensor `name` from ranks' slices (Merged), read whole."""
    return Merged(name, parts)[...]


class SlicedWeights(Mapping):
    """Weights read only when asked, from lazy tensors (models/tensor_file.py's StoredTensor of a
    safetensors or .ckpt file, a sharded step's slices `Merged`, hf_convert's RuleView of an HF
    tensor renamed, transposed or split, mf_convert's RowsOf a fused MindFormers tensor): `[name]` reads
    one whole, `local(name, layout, rank)` only `rank`'s slice of it, so a sharded rank loading full
    weights never holds a whole tensor it does not need. Shapes come from the headers."""

    def __init__(self, tensors: dict):
        self.tensors = tensors
        self.shapes = {name: tuple(t.shape) for name, t in tensors.items()}

    @classmethod
    def of_file(cls, file: str | Path) -> "SlicedWeights":
        return cls(open_tensors(file))

    def __getitem__(self, name: str) -> np.ndarray:
        return self.tensors[name][...]

    def __contains__(self, name) -> bool:  # Mapping's own would read the tensor
        return name in self.shapes

    def __iter__(self):
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)

    def local(self, name: str, layout: tuple, rank: int) -> np.ndarray:
        if self.shapes[name] != tuple(layout[6]):  # stored in another shape: cut from the whole tensor
            return take_slice(self[name], layout, rank)
        return self.tensors[name][local_slice(layout, rank)]


def _shape(values, name: str) -> tuple:
    return values.shapes[name] if isinstance(values, SlicedWeights) else tuple(np.shape(values[name]))


def assign(params, values: dict[str, np.ndarray], what: str, layouts: dict | None = None, rank: int = 0) -> None:
    """Copy `values` into `params` by name; every parameter must be present with its shape. A value may
    be the parameter's own slice (a rank's checkpoint), or the full tensor of a sharded parameter, of
    which `rank`'s slice is taken by the compiled layout (`layouts`: the step's parameter_layout_dict)."""
    from mindspore import Tensor

    layouts = layouts or {}
    by_name = {p.name: p for p in params}
    missing = sorted(set(by_name) - set(values))
    if missing:
        raise CheckpointError(
            f"{what} lacks {len(missing)} tensors (first: {missing[:3]}); "
            "it was written by a different model or optimizer"
        )
    for name, param in by_name.items():
        shape, layout = tuple(param.shape), layouts.get(name)
        sliced = (
            isinstance(values, SlicedWeights) and layout is not None and layout[1] and _shape(values, name) != shape
        )
        value = values.local(name, layout, rank) if sliced else values[name]
        if value.size == 1 and param.size == 1:  # safetensors stores 0-d scalars as shape (1,)
            value = value.reshape(shape)
        if tuple(value.shape) != shape and layout is not None and tuple(value.shape) == tuple(layout[6]):
            value = take_slice(value, layout, rank)
        if tuple(value.shape) != shape:
            raise CheckpointError(
                f"{what}: {name} has shape {tuple(value.shape)}, the model needs "
                f"{tuple(layout[6]) if layout else shape}; check the model config"
            )
        param.set_data(Tensor(value, dtype=param.dtype))


def load_weights(path: str | Path) -> dict[str, np.ndarray]:
    """Weights from a checkpoint folder (verified) or a bare .safetensors file; a sharded rank's folder
    stands for its whole step (read_step_tensors)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist; check checkpoint.load_path")
    if path.is_file():
        return read_tensors(path)
    return read_step_tensors(path, WEIGHTS)


def read_step_tensors(folder: Path, file: str) -> dict[str, np.ndarray]:
    """The tensors of `file` in a checkpoint folder (verified), read whole (step_tensors)."""
    return {name: tensor[...] for name, tensor in step_tensors(folder, file).items()}


def step_tensors(folder: Path, file: str) -> dict:
    """The tensors of `file` in a checkpoint folder (verified) as lazy tensors, nothing read but headers.
    A sharded run's rank folder (`checkpoints/rank_<r>/step_X`, whose state.json holds its compiled
    layouts) stands for the whole step: each tensor is the slices of every rank_*/step_X beside it,
    merged (a read takes from each rank's file only what it needs)."""
    verify_folder(folder)
    if _layouts(folder) is None:
        return open_tensors(folder / file) if (folder / file).is_file() else {}
    parts = {}
    for rank_folder in folder.parent.parent.glob(f"rank_*/{folder.name}"):
        verify_folder(rank_folder)
        held = open_tensors(rank_folder / file) if (rank_folder / file).is_file() else {}
        parts[int(rank_folder.parent.name[len("rank_") :])] = (_layouts(rank_folder), held)
    names = {n for _, tensors in parts.values() for n in tensors}
    return {
        n: Merged(
            n, [(r, layouts.get(n), tensors[n]) for r, (layouts, tensors) in sorted(parts.items()) if n in tensors]
        )
        for n in sorted(names)
    }


def _layouts(folder: Path) -> dict | None:
    """A sharded rank's compiled layouts (state.json "layouts"), or None for a whole checkpoint."""
    state = folder / "state.json"
    return json.loads(state.read_text()).get("layouts") if state.is_file() else None


class WeightsMismatch(CheckpointError):
    """Checkpoint tensors do not match the model's names or shapes. One line; the CLIs exit 2."""


def _first(items, n: int = 3) -> str:
    items = list(items)
    more = f" (+{len(items) - n} more)" if len(items) > n else ""
    return ", ".join(items[:n]) + more


def weight_problems(model: nn.Cell, weights: dict, layouts: dict | None = None) -> list[str]:
    """How `weights` differs from the model's parameter names and full shapes (a compiled sharded model's
    parameters are slices: `layouts`, its parameter_layout_dict, holds the full shapes): [] when they match.
    LoRA adapters may be absent (base weights for a LoRA model: the adapters keep their initial values)."""
    layouts = layouts or {}
    params = {
        p.name: tuple(layouts[p.name][6]) if p.name in layouts else tuple(p.shape)
        for p in model.get_parameters()
        if p.name in weights or not is_adapter(p.name)
    }
    problems = []
    missing = [n for n in params if n not in weights]
    unexpected = [n for n in weights if n not in params]
    wrong = [
        f"{n} {_shape(weights, n)} vs model {shape}"
        for n, shape in params.items()
        if n in weights and _shape(weights, n) != shape
    ]
    if missing:
        problems.append(f"missing {len(missing)}: {_first(missing)}")
    if unexpected:
        problems.append(f"unexpected {len(unexpected)}: {_first(unexpected)}")
    if wrong:
        problems.append(f"wrong shape {len(wrong)}: {_first(wrong)}")
    return problems


def check_weights(model: nn.Cell, weights: dict, layouts: dict | None = None) -> None:
    """Raise WeightsMismatch unless `weights` has exactly the model's parameter names and full shapes
    (weight_problems)."""
    problems = weight_problems(model, weights, layouts)
    if problems:
        raise WeightsMismatch(
            "checkpoint does not match the model config ("
            + "; ".join(problems)
            + "); use the config the checkpoint was trained with"
        )


def held(params, layouts: dict | None, pp: int = 1) -> list:
    """The parameters of `params` a rank's compiled graph holds: every one without a pipeline; a pipeline
    stage compiles only its own, which its compiled layouts (`layouts`, the step's parameter_layout_dict)
    name. What a rank loads, saves and resumes (mindscale/train/checkpoints/checkpointer.py)."""
    params = list(params)
    return params if pp == 1 else [p for p in params if p.name in (layouts or {})]


def load_weights_into(model: nn.Cell, weights: dict, layouts: dict | None = None, rank: int = 0, pp: int = 1) -> None:
    """Copy full weights into the model after checking all names and shapes against the whole model (no
    partial loads). A compiled sharded model takes `rank`'s slice of each, cut by its compiled layout
    (`layouts`); a pipeline stage (`pp` > 1) only the parameters it holds (`held`): from lazy weights
    (SlicedWeights) the other stages' tensors are never read."""
    check_weights(model, weights, layouts)
    assign(
        [p for p in held(model.get_parameters(), layouts, pp) if p.name in weights], weights, "weights", layouts, rank
    )


def load_pretrained(path: str | Path, cfg: Config, sliced: bool = False) -> Mapping[str, np.ndarray]:
    """MindScale-named weights from a MindScale checkpoint (a step folder, a sharded run's rank folder, a
    .safetensors file), a Hugging Face model folder (config.json + safetensors) or a MindFormers LLaMA
    checkpoint (.ckpt or .safetensors, models/mf_convert.py, split by the config's head counts).
    `sliced` (a sharded run): they come as SlicedWeights, nothing read but headers, from which a rank
    reads only the slices of the parameters it holds (load_weights_into); else read whole. Raises
    CheckpointError / WeightsMismatch (one line)."""
    if is_mindformers_checkpoint(path):
        return _loaded(mf_views(read_mindformers(path), cfg.model.num_heads, cfg.model.kv_heads), sliced)
    if is_hf_folder(path):
        hf_model, views = hf_views(*read_hf_folder(path, lazy=True), cfg.model.mtp_depth)
        differ = model_config_differences(hf_model, cfg.model)
        if differ:
            raise WeightsMismatch(
                f"{path}: the Hugging Face model differs from the config: {_first(differ)}; "
                "set finetune.hf_dims=true to take the model dims from its config.json, or set "
                "those model keys"
            )
        return _loaded(views, sliced)
    if sliced and Path(path).is_dir():
        return SlicedWeights(step_tensors(Path(path), WEIGHTS))
    if sliced and Path(path).is_file():
        return SlicedWeights.of_file(path)
    return load_weights(path)


def _loaded(tensors: dict, sliced: bool) -> Mapping[str, np.ndarray]:
    weights = SlicedWeights(tensors)
    return weights if sliced else {name: weights[name] for name in weights}


def with_hf_dims(cfg: Config, hf_folder: str | Path) -> Config:
    """`cfg` with its model dims taken from a Hugging Face folder's config.json. Families with rotary positions
    keep the config's seq_length (max_position_embeddings is a limit, not the training length); dtypes and
    model.mtp_depth stay the config's."""
    if not is_hf_folder(hf_folder):
        raise HFConversionError(
            f"{hf_folder} is not a Hugging Face folder (no config.json); "
            "finetune.hf_dims and generate's HF mode need one"
        )
    hf_model = model_config_from_hf(read_hf_config(hf_folder))
    if not ARCHS[hf_model["arch"]].learned_positions:
        hf_model.pop("seq_length")
    hf_model.pop("mtp_depth", None)  # multi-token prediction is a training choice: the config's model.mtp_depth
    tree = cfg.to_dict()
    tree["model"].update(hf_model)
    try:
        return config_from_tree(tree)
    except ConfigError as exc:
        raise ConfigError(f"with the dims of {hf_folder}: {exc}")


def resolve_model_dims(cfg: Config) -> Config:
    """finetune.hf_dims: the model section comes from checkpoint.load_path's config.json."""
    return with_hf_dims(cfg, cfg.checkpoint.load_path) if cfg.finetune.hf_dims else cfg


def load_inference_weights(path: str | Path, cfg: Config) -> tuple[dict[str, np.ndarray], Config]:
    """(full weights, config of the plain model) for any checkpoint the trainer can load or write.

    A Hugging Face folder brings its own dims; a LoRA run's checkpoint holds only adapters, which are
    merged into the base weights from the config's checkpoint.load_path."""
    if is_hf_folder(path):
        cfg = with_hf_dims(cfg, path)
    base, adapters = split_adapters(load_pretrained(path, cfg))
    if adapters:
        if not cfg.checkpoint.load_path:
            raise WeightsMismatch(
                f"{path} holds LoRA adapters only and the config has no checkpoint.load_path "
                "for the base weights; pass the config the LoRA run used"
            )
        base = load_pretrained(cfg.checkpoint.load_path, cfg)
        base = merge(base, adapters, cfg.finetune.lora)
    return base, without_lora(cfg)
