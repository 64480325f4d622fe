import json, glob, os, re
names = ["llama3_8b","llama2_7b","llama3_1_8b_128k","mixtral_8x7b","comm_inlined"]
sweep = re.findall(r"^(\S+) cell rc", open("/tmp/ap/sweep.log").read(), re.M)
verdict = dict(re.findall(r"^(\S+): ranks .*?\n(?:.*\n)*?  => (SAME|DIFFERENT)", open("/tmp/ap/sweep.log").read(), re.M))
for n in names + sweep:
    def load(api):
        return [json.loads(l) for l in open(f"/tmp/ap/{n}_{api}.json") if l.startswith("{")]
    a, b = load("context"), load("cell")
    IGN = {"compile_s","host_peak_rss_gib","eval_compile_s"}
    same = len(a)==len(b) and all({k:v for k,v in x.items() if k not in IGN}=={k:v for k,v in y.items() if k not in IGN} for x,y in zip(a,b))
    ranks = ", ".join(str(x["rank"]) for x in a)
    cs = " + ".join(f"{x['compile_s']}" for x in a)
    cb = " + ".join(f"{y.get('compile_s')}" for y in b)
    print(f"| `{n}` | {ranks} | {cs} | {cb} | {'same' if same else 'DIFFERENT'} |")
