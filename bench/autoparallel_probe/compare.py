import json, sys
name = sys.argv[1]
IGNORE = {"compile_s", "host_peak_rss_gib", "eval_compile_s"}
def load(api):
    return [json.loads(l) for l in open(f"/tmp/ap/{name}_{api}.json") if l.startswith("{")]
a, b = load("context"), load("cell")
print(f"{name}: ranks {[r['rank'] for r in a]} / {[r['rank'] for r in b]}")
same = len(a) == len(b)
for ra, rb in zip(a, b):
    print(f"  rank {ra['rank']}: compiled {ra['compiled']}/{rb['compiled']} compile_s {ra.get('compile_s')} / {rb.get('compile_s')}"
          f" err {ra.get('error')!r} / {rb.get('error')!r}")
    for k in sorted(set(ra) | set(rb)):
        if k in IGNORE: continue
        if ra.get(k) != rb.get(k):
            same = False
            va, vb = ra.get(k), rb.get(k)
            if isinstance(va, dict) and isinstance(vb, dict):
                keys = [x for x in sorted(set(va) | set(vb)) if va.get(x) != vb.get(x)]
                print(f"    DIFF {k}: {len(keys)} entries, e.g. " + "; ".join(f"{x}: {va.get(x)} -> {vb.get(x)}" for x in keys[:4]))
            elif isinstance(va, list) and isinstance(vb, list):
                sa = {json.dumps(x, sort_keys=True) for x in va}; sb = {json.dumps(x, sort_keys=True) for x in vb}
                print(f"    DIFF {k}: only context {len(sa-sb)}: {list(sa-sb)[:3]}\n      only cell {len(sb-sa)}: {list(sb-sa)[:3]}")
            else:
                print(f"    DIFF {k}: {str(va)[:300]} -> {str(vb)[:300]}")
print(f"  => {'SAME' if same else 'DIFFERENT'}")
# context dumps
import glob, os
for ctx in sorted(glob.glob(f"/tmp/ap/ctx/{name}/context_rank*.json")):
    cell = ctx.replace("context_rank", "cell_rank")
    if not os.path.exists(cell): continue
    x, y = json.load(open(ctx)), json.load(open(cell))
    d = {k: (x.get(k), y.get(k)) for k in sorted(set(x) | set(y)) if x.get(k) != y.get(k)}
    print(f"  context keys differing ({os.path.basename(ctx)}): {d}")
# node-kind histogram of each rank's validate IR, and the strategies (in_strategy attrs) as a multiset
import re
from collections import Counter
NODE = re.compile(r"^\s+%\d+\(\S+\) = (\w+)\(", re.M)
STRAT = re.compile(r"in_strategy: (\([^}]*?\)\)),")
for r in a:
    rank = r["rank"]
    texts = {}
    for api in ("context", "cell"):
        files = sorted(glob.glob(f"/tmp/ap/ir/{name}_{api}/rank{rank}/**/*validate*.ir", recursive=True))
        texts[api] = "".join(open(f).read() for f in files)
    ka, kb = Counter(NODE.findall(texts["context"])), Counter(NODE.findall(texts["cell"]))
    sa, sb = Counter(STRAT.findall(texts["context"])), Counter(STRAT.findall(texts["cell"]))
    dk = {k: (ka[k], kb[k]) for k in set(ka) | set(kb) if ka[k] != kb[k]}
    print(f"  rank {rank} validate IR: {sum(ka.values())} / {sum(kb.values())} nodes, {len(texts['context'])} / {len(texts['cell'])} chars;"
          f" node kinds differing: {dk or 'none'}; strategies same: {sa == sb}")
# every node's kind with its type signature (input and output shapes), as a multiset
SIG = re.compile(r"^\s+%\d+\(\S+\) = (\w+)\(.*\n\s+: (.*)$", re.M)
ATTR_DROP = re.compile(r"instance name: [^,}]*|unique_id[^,}]*|fullname[^,}]*|CNode_\d+|%\d+|@\S+")
for r in a:
    rank = r["rank"]
    sigs = {}
    for api in ("context", "cell"):
        files = sorted(glob.glob(f"/tmp/ap/ir/{name}_{api}/rank{rank}/**/*validate*.ir", recursive=True))
        text = "".join(open(f).read() for f in files)
        sigs[api] = Counter(f"{k} {t}" for k, t in SIG.findall(text))
    d = (sigs["context"] - sigs["cell"]) + (sigs["cell"] - sigs["context"])
    print(f"  rank {rank}: nodes with their shapes differing: {sum(d.values())}" + (f" e.g. {list(d)[:3]}" if d else ""))
# attribute keys (name: value) as a multiset, values dropped for names/ids
KEY = re.compile(r"[{,] (\w+): ")
for r in a:
    rank = r["rank"]
    hist = {}
    for api in ("context", "cell"):
        files = sorted(glob.glob(f"/tmp/ap/ir/{name}_{api}/rank{rank}/**/*validate*.ir", recursive=True))
        hist[api] = Counter(KEY.findall("".join(open(f).read() for f in files)))
    d = {k: (hist["context"][k], hist["cell"][k]) for k in set(hist["context"]) | set(hist["cell"]) if hist["context"][k] != hist["cell"][k]}
    print(f"  rank {rank}: attribute keys differing in count: {d or 'none'} (of {len(hist['context'])} keys)")
