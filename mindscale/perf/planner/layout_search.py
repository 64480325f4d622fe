"""search(): the layouts of a config for a number of devices that fit, ranked by predicted tokens/s (tools/plan.py
--search): data, tensor and pipeline degrees, chunks per stage, micro batches, expert parallel, and the fewest
recomputed or offloaded layers that make each fit."""

from __future__ import annotations

from mindscale.config import Config, ConfigError, offload_layer_counts
from mindscale.perf.gemm_peak import device_peak_tflops
from mindscale.perf.planner.caches import _layout
from mindscale.perf.planner.full_plan import plan
from mindscale.perf.planner.memory import memory_budget_gib, stage_host_bytes, stage_memory
from mindscale.perf.planner.replan import PlanError, _batch_overrides, with_overrides
from mindscale.perf.planner.sizes import GIB


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def balanced_offset(layers: int, stages: int) -> list[int] | int:
    """stage_offset giving the remainder layers to the middle stages (stage 0 holds the most micro
    batches in flight, the last stage the logits)."""
    extra = layers % stages
    if not extra:
        return 0
    return [0] + [1] * extra + [0] * (stages - 1 - extra)


def interleaved_offset(layers: int, stages: int, interleave: int) -> list | int:
    """stage_offset for v chunks per stage: the stage totals of `balanced_offset`, each split over its
    chunks as evenly as it goes, the extra layers in its later chunks (stage 0 holds its chunk 0 for
    2p - 1 of its v·p + p - 1 forwards in flight, the others p times: the lighter chunk 0, the less
    memory). Per stage (an int or p ints) when v divides every stage's layers, else per chunk (v lists
    of p ints on top of layers // (p·v))."""
    offset = balanced_offset(layers, stages)
    if interleave == 1:
        return offset
    per_stage = [layers // stages + o for o in ([offset] * stages if isinstance(offset, int) else offset)]
    if all(n % interleave == 0 for n in per_stage):
        return offset
    base = layers // (stages * interleave)
    return [
        [n // interleave + (chunk >= interleave - n % interleave) - base for n in per_stage]
        for chunk in range(interleave)
    ]


def interleave_choices(layers: int, stages: int, micro_batches: int, largest: int = 8) -> list[int]:
    """Chunks per stage the search tries: 1, and with a pipeline every v <= `largest` that leaves each
    chunk a layer (p·v <= layers) where the micro batches come in groups of p (Megatron-LM's interleaved
    schedule needs m to be a multiple of p; Narayanan et al. 2021, §2.2.2)."""
    if stages == 1 or micro_batches % stages:
        return [1]
    return [v for v in range(1, largest + 1) if stages * v <= layers]


def _fewest_layers_that_fit(cfg: Config, role: str) -> list[int] | None:
    """Fewest layers per stage that make every stage fit when they are `role` ("recomputed" in cfg's recompute
    mode, or "offloaded"), or None if even all of a stage's layers do not."""
    budget = memory_budget_gib(cfg) * GIB
    out = []
    for k, n in enumerate(_layout(cfg).layers_per_stage):
        fits = lambda r: stage_memory(cfg, k, **{role: r})["total"] <= budget  # noqa: E731
        if fits(0):
            out.append(0)
            continue
        if not fits(n):
            return None
        low, high = 1, n  # from one such layer on, memory falls with each more: bisect
        while low < high:
            mid = (low + high) // 2
            low, high = (low, mid) if fits(mid) else (mid + 1, high)
        out.append(low)
    return out


def _memory_candidates(base: Config, shard: list[str]) -> list[list[str]]:
    """The ways the search tries to fit `base` (no recompute, no offload) with `shard` (the accumulation-buffer
    setting, recompute.comm): as it is, selective recompute, the fewest fully recomputed layers per stage that fit,
    and offload (`_offload_candidate`)."""
    try:
        fitted = with_overrides(base, shard) if shard else base
    except ConfigError:  # e.g. an accumulation shard the layout cannot take
        return []
    out = [shard, shard + ["recompute.mode=selective"]]
    full = _fewest_layers_that_fit(with_overrides(fitted, ["recompute.mode=full"]), "recomputed")
    if full is not None and any(full):
        out.append(shard + ["recompute.mode=full", f"recompute.layers={_yaml(full)}"])
    if full is not None:
        # an offloaded layer keeps more on the device (Q, K, V) than a recomputed one (its input): where recomputing
        # every layer does not fit, offloading cannot ...
        offload = _offload_candidate(fitted, max(full))
    else:
        # ... unless a recomputed layer keeps its communication outputs (tensor parallel without recompute.comm),
        # which outweigh Q, K and V: then offload alone may fit
        offload = _offload_candidate(fitted, None) if _layout(fitted).tp > 1 and not fitted.recompute.comm else None
    if offload:
        out.append(shard + offload)
    return out


def _fits_as_is(base: Config, overrides: list[str]) -> bool:
    """Whether every stage of `base` with `overrides` fits without recompute or offload (False if they do not
    validate)."""
    try:
        cfg = with_overrides(base, overrides) if overrides else base
    except ConfigError:
        return False
    budget = memory_budget_gib(cfg) * GIB
    return all(stage_memory(cfg, k)["total"] <= budget for k in range(_layout(cfg).pp))


def _offload_candidate(base: Config, recompute_fits: int | None) -> list[str] | None:
    """Overrides that fit `base` with the fewest offloaded layers per stage after recomputing the fewest r layers
    of every stage for which host memory holds what is offloaded, r below `recompute_fits` (that many fit by
    recompute alone; None: no number does, r is 0); None if there is no such r, or if its hardware and mode cannot
    offload (validate.py's rules). The more a stage recomputes, the less it offloads: after r = 0, r is bisected."""

    def fitted(r: int) -> list[str] | None:
        recompute = ["recompute.mode=full", f"recompute.layers={r}"] if r else []
        cfg = with_overrides(base, recompute + ["offload.layers=1"])
        offloaded = _fewest_layers_that_fit(cfg, "offloaded")
        if offloaded is None or not any(offloaded):
            return None
        host = max(stage_host_bytes(cfg, k, n) for k, n in enumerate(offloaded)) / GIB
        return recompute + [f"offload.layers={_yaml(offloaded)}"] if host <= cfg.hardware.host_memory_gib else None

    try:
        if recompute_fits is None:
            return fitted(0)
        first = fitted(0) if recompute_fits else None
        if first or not recompute_fits:
            return first
        low, high = 1, recompute_fits
        while low < high:
            mid = (low + high) // 2
            low, high = (low, mid) if fitted(mid) else (mid + 1, high)
        return fitted(low) if low < recompute_fits else None
    except ConfigError:  # no host link in the profile, CPU, PyNative, no lazy_inline
        return None


def tensor_splits(tp: int) -> list[tuple[int, int]]:
    """The tensor-parallel splits (tp_x, tp_y) the search tries for degree `tp`: 1D, and from t = 8 on 2D as 2 x t/2.
    A pair h -> e -> h sends 2T[e(x-1) + h(y-1)]/xy under 2D against 1D's 4T·h(t-1)/t: at t = 4 that is 1.4 times
    1D's bytes for a SwiGLU MLP (e about 3.5h), at t = 8 as 2 x 4 0.85-0.88 times; x = 2 sends the fewest, since the
    MLP's width e crosses the x ranks (docs/planner.md, "2D tensor parallel")."""
    return [(1, 1)] + ([(2, tp // 2)] if tp >= 8 and tp % 2 == 0 else [])


def _layout_overrides(
    cfg: Config, dp: int, tp: int, pp: int, mbs: int, v: int = 1, ep: int = 1, split: tuple[int, int] = (1, 1)
) -> list[str] | None:
    model = cfg.model
    widths = (
        model.num_heads,
        model.kv_heads,
        model.ffn_hidden_size,
        model.vocab_size,
        *((model.moe.expert_ffn(model.ffn_hidden_size),) if model.spec.moe else ()),
    )
    if any(x % tp for x in widths) or tp > cfg.hardware.devices_per_node:
        return None
    if pp > model.num_layers or (tp > 1 and model.seq_length % tp):
        return None
    batch = _batch_overrides(cfg, dp, pp, mbs)
    if batch is None:
        return None
    offset = interleaved_offset(model.num_layers, pp, v)
    return [
        f"parallel.data_parallel={dp}",
        f"parallel.model_parallel={tp}",
        f"parallel.pipeline_stage={pp}",
        f"parallel.expert_parallel={ep}",
        *batch,
        f"train.micro_batch_size={mbs}",
        f"train.global_batch_size={cfg.samples_per_step}",
        f"parallel.pipeline_interleave={v}",
        "parallel.pipeline_scheduler=1f1b",
        f"parallel.stage_offset={_yaml(offset)}",
        *(  # named where 2D is tried or the config has it
            [f"parallel.tp_x={split[0]}", f"parallel.tp_y={split[1]}", "parallel.tp_z=1"]
            if split != (1, 1) or cfg.parallel.tp_x * cfg.parallel.tp_y > 1
            else []
        ),
        f"parallel.sequence_parallel={str(tp > 1 and split == (1, 1)).lower()}",  # 2D splits the stream already
        f"parallel.optimizer_shard={str(dp > 1).lower()}",
        "parallel.gradient_accumulation_shard=false",
    ]


def _yaml(value) -> str:
    if isinstance(value, list):
        return "[" + ",".join(_yaml(v) for v in value) + "]"
    return str(value).lower() if isinstance(value, bool) else str(value)


def search(
    cfg: Config,
    devices: int,
    top: int = 5,
    peak_tflops: float | None = None,
    efficiency: float | None = None,
    micro_batch_sizes: tuple = (1, 2, 4),
) -> list[dict]:
    """Valid (dp, mp, pp, interleave, micro batches, recompute, recompute.comm, offload; a mixture of experts'
    expert_parallel; 2D tensor parallel where the model takes it, tensor_splits) layouts for `devices`
    keeping the global batch, ranked by predicted tokens/s among those that
    fit. Each entry: overrides, plan. The config's context_parallel c is kept, not searched: the layouts share
    devices / c among dp x mp x pp."""
    peak = peak_tflops if peak_tflops is not None else device_peak_tflops(cfg)
    found = []
    cp = cfg.parallel.context_parallel
    if devices % cp:
        raise PlanError(
            f"--devices {devices} is not a multiple of parallel.context_parallel={cp}; pick a multiple "
            "or change it with --set"
        )
    shapes = [
        (tp, pp, mbs)
        for tp in _divisors(devices // cp)
        for pp in _divisors(devices // cp // tp)
        for mbs in micro_batch_sizes
    ]
    for tp, pp, mbs in shapes:
        dp = devices // (tp * pp * cp)
        micro = cfg.samples_per_step // (dp * mbs)
        experts = cfg.model.moe.num_experts
        expert_splits = [e for e in _divisors(dp) if experts % e == 0] if experts else [1]
        choices = [
            (v, ep, split)
            for v in interleave_choices(cfg.model.num_layers, pp, micro)
            for ep in expert_splits
            for split in tensor_splits(tp)
        ]
        for v, ep, split in choices:
            layout = _layout_overrides(cfg, dp, tp, pp, mbs, v, ep, split)
            if layout is None:
                continue
            try:
                base = with_overrides(
                    cfg,
                    layout
                    + ["recompute.mode=none", "recompute.layers=null", "recompute.comm=false", "offload.layers=0"],
                )
            except ConfigError:
                continue
            shards = [[]]
            if _layout(base).accumulates_in_graph and _layout(base).optimizer_shard and cfg.run.reuse_layer_graph:
                shards.append(["parallel.gradient_accumulation_shard=true"])
            candidates = []
            for shard in shards:
                candidates += _memory_candidates(base, shard)
                # with tensor parallel, also repeating its communication in the backward instead of keeping its
                # outputs: that only adds communication, so only where the layout does not fit as it is
                if tp > 1 and not _fits_as_is(base, shard):
                    candidates += _memory_candidates(base, shard + ["recompute.comm=true"])
            for extra in candidates:
                try:
                    candidate = with_overrides(base, extra) if extra else base
                except ConfigError:  # e.g. an accumulation shard the layout cannot take
                    continue
                result = plan(candidate, peak, efficiency)
                if result["fits"]:
                    keeps = (
                        []
                        if any(x.startswith("recompute.mode=") for x in extra)
                        else ["recompute.mode=none", "recompute.layers=null"]
                    )
                    if any(offload_layer_counts(cfg)) and not any(x.startswith("offload.") for x in extra):
                        keeps.append("offload.layers=0")
                    if cfg.recompute.comm and "recompute.comm=true" not in extra:
                        keeps.append("recompute.comm=false")
                    sets = list({o.split("=", 1)[0]: o for o in layout + keeps + extra}.values())  # last wins
                    found.append({"overrides": sets, "plan": result})
    if not found:
        raise PlanError(
            f"no layout of {cfg.run.name} fits {devices} x {cfg.hardware.name} "
            f"({cfg.hardware.memory_gib:g} GiB) at global batch {cfg.samples_per_step}; "
            "use more devices, a smaller micro batch or a shorter sequence"
        )
    found.sort(key=lambda c: (-c["plan"]["predicted"]["tokens_per_s"], c["plan"]["memory_gib"]["total"]))
    return found[:top]
