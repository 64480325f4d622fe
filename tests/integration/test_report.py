"""tools/report.py: the self-contained HTML report and its PNGs."""

import base64
import json
import re
import shutil
import statistics

import pytest

from tests.run_folder import ROOT, write_run
from tools import report
from mindscale.perf import flops
from mindscale.config import Layout, load_config

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run resumed once (steps 4-6 re-run after a restart), with an Ascend profile in profile/."""
    run = write_run(
        tmp_path_factory.mktemp("report"), "tiny_report", [6.0, 1.0, 1.1, 1.2, 1.0, 1.3], ["recompute.mode=selective"]
    )
    lines = (run / "metrics.jsonl").read_text().splitlines()
    resumed = []
    for i, line in enumerate(lines[3:], 1):
        record = json.loads(line)
        record["elapsed_s"] = float(i)
        resumed.append(json.dumps(record))
    (run / "metrics.jsonl").write_text("\n".join(lines + resumed) + "\n")
    shutil.copytree(ROOT / "tests" / "fixtures" / "ascend_profile", run / "profile")
    return run


@pytest.fixture(scope="module")
def built(run_dir, tmp_path_factory):
    output = tmp_path_factory.mktemp("out") / "tiny.html"
    assert report.main([str(run_dir), "--output", str(output)]) == 0
    return output, output.read_text()


def test_html_embeds_every_plot_and_writes_pngs(built):
    output, page = built
    embedded = re.findall(r'<img alt="(\w+)" src="data:image/png;base64,([^"]+)"', page)
    assert [name for name, _ in embedded] == ["loss_lr", "throughput", "mfu_hfu", "memory"]
    for name, data in embedded:
        png = output.with_name(f"tiny_{name}.png")
        assert png.read_bytes() == base64.b64decode(data) and png.read_bytes()[:8] == PNG
    assert "<script" not in page and "http" not in page.split("<h2>Resolved config</h2>")[0].lower()


def test_measurement_skips_warmup_of_every_segment(built, run_dir):
    _, page = built
    # segments: steps 1-3 (6.0, 1.0, 1.1) and the resume 4-6 (1.2, 1.0, 1.3); first of each dropped
    kept = [1.0, 1.1, 1.0, 1.3]
    assert f"<td>step time</td><td>s</td><td>{statistics.mean(kept):.4f}</td>" in page
    assert "6 records, 4 after warm-up (4 steps)" in page


def test_formula_and_by_hand_mfu(built, run_dir):
    _, page = built
    cfg = load_config(run_dir / "config.yaml")
    fpt = flops.model_flops_per_token(cfg.model)
    assert f"model FLOPs per token = {fpt:.4g}" in page
    layout = Layout.of(cfg)
    hfpt = flops.hardware_flops_per_token(cfg.model, layout.recompute, len(layout.recomputed))
    assert f"hardware FLOPs per token = {hfpt:.4g}" in page
    tokens = cfg.samples_per_step * cfg.model.seq_length * 4 / sum([1.0, 1.1, 1.0, 1.3])
    by_hand = tokens * fpt / (cfg.devices * 0.05e12)
    assert f"= {by_hand:.3%} (the MFU above: {by_hand:.3%})" in page
    assert f"<td>MFU</td><td></td><td>{by_hand:.2%}</td>" in page


def test_config_and_profile_sections(built, run_dir):
    _, page = built
    assert "recompute:\n  mode: selective" in page and "hidden_size: 128" in page
    assert "likely communication-bound" in page and "ascend layout" in page


def test_default_output_in_run_folder(run_dir, capsys):
    assert report.main([str(run_dir)]) == 0
    printed = capsys.readouterr().out.split()
    assert printed[0] == str(run_dir / "report.html") and len(printed) == 5


def test_bad_input(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        report.main([str(tmp_path / "missing")])
    assert exc.value.code == 2 and capsys.readouterr().err.count("\n") == 1
    cut = write_run(tmp_path, "cut", [6.0, 1.0, 1.0], truncate=True)
    assert report.main([str(cut)]) == 0
    assert "truncated line" in capsys.readouterr().err
    assert "ends in a truncated line" in (cut / "report.html").read_text()


def test_planner_prediction_next_to_measurement(built, run_dir):
    from mindscale.perf import planner

    _, page = built
    cfg = load_config(run_dir / "config.yaml")
    plan = planner.plan(cfg, peak_tflops=0.05)
    step = statistics.mean([1.0, 1.1, 1.0, 1.3])
    predicted = plan["predicted"]["step_time_s"]
    assert (
        f"<td>step time</td><td>s</td><td>{step:.4f}</td><td>{predicted:.4f}</td><td>{step / predicted:.2f}</td>"
    ) in page
    assert "<td>MFU</td><td></td><td>" in page and f"{plan['predicted']['mfu']:.2%}" in page
    assert f"{plan['memory_gib']['total']:.2f}" in page and plan["predicted"]["assumptions"][0] in page


def test_validation_losses_appear_in_the_loss_plot_and_a_table(tmp_path):
    """Records with val_loss (train.eval_interval) add a validation line to loss_lr and a table of passes."""
    run = write_run(
        tmp_path,
        "validated",
        [6.0, 1.0, 1.1, 1.2],
        ["data.valid_path=/data/valid", "train.eval_interval=2", "train.eval_steps=3"],
    )
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for record in records[1::2]:
        record.update(val_loss=record["loss"] + 0.25, val_ppl=2.0 ** record["step"], val_time_s=0.5)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    output = tmp_path / "validated.html"
    assert report.main([str(run), "--output", str(output)]) == 0
    page = output.read_text()
    section = page.split("<h2>Validation</h2>")[1].split("<h2>")[0]
    assert "first 3 x 8 sequences of /data/valid" in section
    assert re.findall(r"<tr><td>(\d+)</td><td>([\d.]+)</td><td>([\d.]+)</td>", section) == [
        ("2", f"{records[1]['loss'] + 0.25:.4f}", "4.00"),
        ("4", f"{records[3]['loss'] + 0.25:.4f}", "16.00"),
    ]
    plain = write_run(tmp_path, "plain", [6.0, 1.0, 1.1, 1.2])  # the same records without val_loss
    assert report.main([str(plain), "--output", str(tmp_path / "plain.html")]) == 0
    assert "<h2>Validation</h2>" not in (tmp_path / "plain.html").read_text()
    assert output.with_name("validated_loss_lr.png").read_bytes() != (tmp_path / "plain_loss_lr.png").read_bytes()
    assert output.with_name("validated_throughput.png").read_bytes() == (tmp_path / "plain_throughput.png").read_bytes()


def test_the_data_mix_and_the_wait_for_data_are_in_the_page(tmp_path, capsys):
    """A blend's data_tokens (metrics.jsonl) next to the configured shares, and data_wait_s over the steps after
    warm-up as a share of their step time; the same mix as the stdout line. A run without them has no section."""
    run = write_run(
        tmp_path,
        "blended",
        [6.0, 1.0, 1.1, 1.2],
        ["data.blend=[{path: /data/web, weight: 3}, {path: /data/code, weight: 1}]"],
    )
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for r, wait in zip(records, (2.0, 0.01, 0.03, 0.02)):
        r.update(data_wait_s=wait, data_tokens={"/data/web": 96 * r["step"], "/data/code": 32 * r["step"]})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    output = tmp_path / "blended.html"
    assert report.main([str(run), "--output", str(output)]) == 0
    section = output.read_text().split("<h2>Data</h2>")[1].split("<h2>")[0]
    assert "in steps 1 to 4" in section
    assert re.findall(r"<tr><td>([^<]+)</td><td>([\d.]+%)</td><td>([\d,]+)</td><td>([\d.]+%)</td></tr>", section) == [
        ("/data/web", "75.0%", "384", "75.0%"),
        ("/data/code", "25.0%", "128", "25.0%"),
    ]
    assert "waited 20.00 ms per step" in section and "1.82% of their step time (1100.0 ms)" in section
    assert "data mix at step 4: /data/web 75.0% (384 tokens), /data/code 25.0% (128 tokens)" in capsys.readouterr().out
    plain = write_run(tmp_path, "plain", [6.0, 1.0, 1.1, 1.2])
    assert report.main([str(plain), "--output", str(tmp_path / "plain.html")]) == 0
    assert "<h2>Data</h2>" not in (tmp_path / "plain.html").read_text()
