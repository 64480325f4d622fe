import os, sys, time, re, json, shutil
from collections import Counter
from pathlib import Path
sys.path.insert(0, "tests/dryrun"); sys.path.insert(0, ".")
import test_communication as tc
from mindscale.config import Layout, load_config
sets = [*tc.TWIN, *tc.OPTIONS["reused"]]
layout = Layout.of(load_config(tc.TINY_LLAMA, sets), "Ascend")
out = {}
for api in ("context", "cell"):
    if api == "cell": os.environ["MINDSCALE_PARALLEL_API"] = "cell"
    else: os.environ.pop("MINDSCALE_PARALLEL_API", None)
    for rank in (0, layout.devices - 1):
        folder = Path(f"/tmp/ap/backend/{api}_{rank}"); shutil.rmtree(folder, ignore_errors=True); folder.mkdir(parents=True)
        t = time.time()
        ((report, ir, backend),) = tc.compile_backend(sets, [rank], layout.devices, folder)
        out[(api, rank)] = (report, ir, backend, time.time() - t)
NODE = re.compile(r"^\s+%\d+\(\S+\) = (\w+)\(", re.M)
for rank in (0, layout.devices - 1):
    (ra, ia, ba, ta), (rb, ib, bb, tb) = out[("context", rank)], out[("cell", rank)]
    keep = lambda r: {k: v for k, v in r.items() if k not in ("compile_s", "host_peak_rss_gib")}
    print(f"rank {rank}: wall {ta:.1f}/{tb:.1f}s compile_s {ra['compile_s']}/{rb['compile_s']} report same: {keep(ra) == keep(rb)}")
    if keep(ra) != keep(rb):
        print("  differing keys:", [k for k in keep(ra) if keep(ra)[k] != keep(rb).get(k)])
    print("  gradient all-reduces (validate) same:", tc.gradient_reduces(ia) == tc.gradient_reduces(ib), len(tc.gradient_reduces(ia)))
    ga, gb = Counter(tc.gradient_reduces(ba)), Counter(tc.gradient_reduces(bb))
    print("  fused gradient all-reduces (backend) same:", ga == gb, sum(ga.values()), sum(gb.values()))
    ka, kb = Counter(NODE.findall(ba)), Counter(NODE.findall(bb))
    print("  backend node kinds differing:", {k: (ka[k], kb[k]) for k in set(ka) | set(kb) if ka[k] != kb[k]} or "none",
          "MatMulAllReduce", ka["MatMulAllReduce"], kb["MatMulAllReduce"])
for rank in (0, layout.devices - 1):
    da, db = out[("context", rank)][0]["device_memory"], out[("cell", rank)][0]["device_memory"]
    norm = lambda d: json.loads(json.dumps(d).replace("network-TrainStep/", ""))
    print(rank, "device_memory same but for the scope names:", norm(da) == norm(db),
          {k: da[k] for k in da if k in ("used_bytes", "peak_bytes", "somas_bytes")})
