"""The recorded MindSpore memory plans of the shipped configs (bench/compiled_memory.json) and what reads them."""

import pytest

from mindscale.config import REPO_ROOT, load_config
from mindscale.perf.planner import compiled_memory
from mindscale.perf.planner.text import shipped_configs

LLAMA2_13B = REPO_ROOT / "configs" / "llama2" / "llama2_13b.yaml"
LLAMA2_70B = REPO_ROOT / "configs" / "llama2" / "llama2_70b.yaml"


def rank(peak_mib, pool_mib=62_464):
    return {"rank": 0, "stage": 0, "peak_mib": peak_mib, "pool_mib": pool_mib, "used_mib": peak_mib}


def test_a_record_stops_counting_when_the_layout_it_was_compiled_for_changes():
    cfg = load_config(LLAMA2_13B)
    records = {"configs/llama2/llama2_13b.yaml": {"fingerprint": compiled_memory.fingerprint(cfg), "ranks": []}}
    assert compiled_memory.current(records, LLAMA2_13B, cfg) is not None
    for change in ("model.seq_length=2048", "recompute.mode=none", "hardware.max_device_memory_gib=60"):
        changed = load_config(LLAMA2_13B, [change])
        assert compiled_memory.current(records, LLAMA2_13B, changed) is None, change
    # what does not size device memory leaves it standing, and so does a key written at its default
    for same in (
        "train.lr=1e-4",
        "checkpoint.save_interval=7",
        "hardware.storage_gbps=3",
        "parallel.context_parallel=1",
    ):
        assert compiled_memory.current(records, LLAMA2_13B, load_config(LLAMA2_13B, [same])) is not None, same


def test_a_plan_of_several_kernel_graphs_is_kept_but_not_counted():
    """Each graph's SOMAS block is its own; the reading is then no step's peak (compiled_memory.whole_step)."""
    cfg = load_config(LLAMA2_13B)
    one, split = (
        {"fingerprint": compiled_memory.fingerprint(cfg), "ranks": [{**rank(40_000), "graphs": n}]} for n in (1, 404)
    )
    assert compiled_memory.current({"configs/llama2/llama2_13b.yaml": one}, LLAMA2_13B, cfg) is one
    assert compiled_memory.current({"configs/llama2/llama2_13b.yaml": split}, LLAMA2_13B, cfg) is None


def test_offloads_host_copies_are_not_device_memory():
    record = {"overrides": [], "ranks": [{**rank(60_000), "used_mib": 58_000, "host_copy_mib": 7_000}]}
    assert compiled_memory.on_device_mib(record["ranks"][0], "used_mib") == 51_000
    assert compiled_memory.spare_gib(LLAMA2_13B, record) == pytest.approx((62_464 - 53_000) / 1024)


def test_the_busiest_rank_is_the_one_with_the_largest_plan_fragments_included():
    record = {"overrides": [], "ranks": [rank(50_000), {**rank(61_429), "stage": 3}]}
    assert compiled_memory.busiest(LLAMA2_13B, record)["stage"] == 3
    assert compiled_memory.spare_gib(LLAMA2_13B, record) == pytest.approx((62_464 - 61_429) / 1024)


def test_every_compiled_shipped_config_leaves_the_spare_its_kernels_need():
    """Where MindSpore's plan of a shipped layout is recorded, its busiest rank's shipped step leaves SPARE_GIB of
    the pool free (kernel workspaces, which level 1 does not size, live there); a config whose layout changed since has no
    current record and is not judged by a stale one (`python bench/compiled_memory.py --stale` lists them)."""
    records = compiled_memory.load()
    judged = {p: compiled_memory.current(records, p, load_config(p)) for p in shipped_configs()}
    judged = {p: record for p, record in judged.items() if record}
    assert judged, "no shipped config has a current record"
    short = {p.stem: round(compiled_memory.spare_gib(p, r), 2) for p, r in judged.items()}
    assert all(gib >= compiled_memory.SPARE_GIB for gib in short.values()), short


def test_the_planner_holds_to_every_recorded_plan_within_a_tenth():
    """The planner's device memory for each recorded rank (its figure now, for the overrides the rank was compiled
    with) over what MindSpore's plan holds at its busiest step: within 0.9-1.1 (issue 49's band). A planner change
    that loses a term MindSpore keeps (as qk-norm's fp32 tensors were, 0.88 on qwen3_8b) fails here."""
    records = compiled_memory.load()
    ratios = {}
    for path in shipped_configs():
        record = compiled_memory.current(records, path, load_config(path))
        for r in record["ranks"] if record else []:
            ratios[f"{path.stem} stage {r['stage']}"] = compiled_memory.planner_mib(
                path, record, r["stage"]
            ) / compiled_memory.on_device_mib(r, "used_mib")
    assert ratios and all(0.9 <= x <= 1.1 for x in ratios.values()), ratios


def test_micro_batches_are_cut_within_mindspores_one_graph_limit():
    """bench/compiled_memory.py cuts the micro batches to 2p (+ m mod p) where the step then calls the layer graph at
    most ONE_GRAPH_CALLS times, else to p (+ m mod p); beyond even that (p x v > 64) the config is not recordable."""
    from bench.compiled_memory import ONE_GRAPH_CALLS, fewer_micro_batches

    def cut(*sets):
        out = fewer_micro_batches(
            load_config(LLAMA2_13B, ["recompute.layers=null", "train.global_batch_size=null", *sets])
        )
        return out and out[0]

    assert cut("parallel.pipeline_stage=8", "parallel.micro_batch_num=64") == "parallel.micro_batch_num=16"
    assert cut("parallel.pipeline_stage=64", "parallel.micro_batch_num=384", "model.num_layers=64") == (
        "parallel.micro_batch_num=64"
    )
    interleaved = ("parallel.pipeline_stage=8", "parallel.pipeline_interleave=8", "model.num_layers=64")
    assert cut(*interleaved, "parallel.micro_batch_num=16") == "parallel.micro_batch_num=8"
    assert ONE_GRAPH_CALLS // 6 < 16  # gpt3_175b's 16 stages x 6 chunks
    gpt3_175b = ("parallel.pipeline_stage=16", "parallel.pipeline_interleave=6", "model.num_layers=96")
    assert cut(*gpt3_175b, "parallel.micro_batch_num=32") is None
    no_stages = ("parallel.pipeline_stage=1", "parallel.micro_batch_num=1", "parallel.gradient_accumulation_steps=8")
    no_stages += ("parallel.gradient_accumulation_shard=false",)
    assert cut(*no_stages) == "parallel.gradient_accumulation_steps=2"


def test_the_spare_is_judged_for_the_shipped_step_beyond_the_compiled_one():
    """A record compiled with fewer micro batches (one kernel graph) is judged with the planner's bytes for what the
    shipped step holds beyond it: on llama2_70b's stage 0 (tp 4, sequence parallel) at 16 micro batches, the views
    256 micro batches' many graphs keep (8 in flight x 10 layers x [4096, 8192/4] + [4096/4, 8192] bf16); its last
    stage's stays the busiest only without."""
    record = {
        "overrides": ["parallel.micro_batch_num=16", "train.global_batch_size=null"],
        "ranks": [rank(50_000), {**rank(51_000), "stage": 7}],
    }
    extra = 8 * 10 * 4096 * 8192 * 2 / 2 / 2**20
    assert compiled_memory.shipped_extra_mib(LLAMA2_70B, record, 0) == pytest.approx(extra)
    assert compiled_memory.busiest(LLAMA2_70B, record)["stage"] == 0
    assert compiled_memory.spare_gib(LLAMA2_70B, record) == pytest.approx((62_464 - 50_000 - extra) / 1024)


def test_a_step_of_more_layer_calls_than_mindspore_inlines_is_said_to_run_as_many_graphs():
    """256 micro batches call the layer graph over schedule.ONE_GRAPH_CALLS times: the plan counts the one-graph
    step and its text says the shipped one runs as many graphs (docs/planner.md, "One kernel graph or many")."""
    from mindscale.perf.planner.full_plan import plan
    from mindscale.perf.planner.text import text

    many = plan(load_config(LLAMA2_13B))
    one = plan(load_config(LLAMA2_13B, ["parallel.micro_batch_num=64", "train.global_batch_size=null"]))
    assert (many["layer_graph_calls"], one["layer_graph_calls"]) == (256, 64)
    assert "calls the layer graph 256 times" in text(many) and "layer graph" not in text(one)


def test_many_kernel_graphs_add_the_views_each_layer_call_in_flight_keeps():
    """Over 64 calls of the layer graph the planner adds, per layer call in flight, the views the many graphs keep
    (memory._split_views_bytes): on llama2_13b's stage 0 none at tp 1 with flash attention (the backward recomputes
    wo's view of the kernel's output, Layout.recomputes_attention_view), 4 micro batches x 10 layers of a bf16
    [4096, 5120] tensor with the composite attention, and a quarter of it each ([S, H/4] + [S/4, H]) at tp 4 with
    sequence parallel."""
    from mindscale.perf.planner.memory import stage_memory

    def extra(*sets):
        cut = ["parallel.micro_batch_num=64", "train.global_batch_size=null", *sets]
        shipped = ["parallel.micro_batch_num=256", "train.global_batch_size=null", *sets]
        return (
            stage_memory(load_config(LLAMA2_13B, shipped), 0)["total"]
            - stage_memory(load_config(LLAMA2_13B, cut), 0)["total"]
        )

    view = 4096 * 5120 * 2
    assert extra() == 0
    assert extra("model.attention=composite") == 4 * 10 * view
    tp4 = ("parallel.model_parallel=4", "parallel.data_parallel=1", "parallel.sequence_parallel=true")
    assert extra(*tp4, "parallel.gradient_accumulation_shard=false") == pytest.approx(4 * 10 * view / 2)


def test_a_config_that_cannot_be_recorded_is_refused_in_one_line_before_any_compile(capsys, tmp_path):
    """gpt3_175b's 16 stages x 6 chunks exceed the one-graph limit at any cut, a config outside the repository has
    no key, a missing file is missing: each is one line and exit 2, checked before the first --config compiles,
    and the records file is left as it was."""
    from bench.compiled_memory import main

    outside = tmp_path / "mine.yaml"
    outside.write_text((REPO_ROOT / "configs" / "tiny" / "llama_tiny.yaml").read_text())
    before = compiled_memory.RECORDS.read_bytes()
    for bad in (REPO_ROOT / "configs" / "gpt3" / "gpt3_175b.yaml", outside, REPO_ROOT / "configs" / "nope.yaml"):
        with pytest.raises(SystemExit) as exc:
            main(["--config", str(LLAMA2_13B), "--config", str(bad)])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert compiled_memory.RECORDS.read_bytes() == before
