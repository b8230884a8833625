"""(Probe of docs/perf-notes.md lead 5 g; its answer: benchmarks/results/e2e-ro-host-qwen3-8b-h100-2026-12-06.md.)
Host time of a reduce-overhead decode step, stock vs patched, each in its own pinned
process: medians without a profiler, then cProfile of N steps (functions by tottime)."""
import cProfile, io, json, os, pstats, statistics, subprocess, sys, time
import torch
DEV = os.environ.get("DEV", "cuda")
def sync():
    if DEV == "cuda": torch.cuda.synchronize()

def child(variant, batch, steps, out):
    from qkrope.bench.e2e import _Variant, PROMPT, VOCAB, step_guards
    core = max(os.sched_getaffinity(0)); os.sched_setaffinity(0, {core})
    g = torch.Generator().manual_seed(0)
    stream = torch.randint(0, VOCAB if DEV == "cuda" else 64, (batch, PROMPT + 2 * steps + 140), generator=g)
    v = _Variant(variant, "qwen3-8b", 4, DEV, 0)
    os.sched_setaffinity(0, set(range(os.cpu_count())))
    v.setup("reduce-overhead", "decode", stream, 10)
    os.sched_setaffinity(0, {core})
    st = v.stepper
    from torch._dynamo.utils import counters
    tree = None
    if DEV == "cuda":
        from torch._inductor import cudagraph_trees as ct
        m = ct.get_manager(0, create_if_none_exists=False)
        if m is not None:
            tree = dict(funcs=len(m.ids_to_funcs), nodes=sum(1 for _ in m.get_roots()) if hasattr(m, "get_roots") else None,
                        mutated=[len(f.mutated_input_idxs) for f in m.ids_to_funcs.values()],
                        static=[len(f.static_input_idxs) for f in m.ids_to_funcs.values()],
                        inputs=[len(f.placeholders) for f in m.ids_to_funcs.values()])
    inductor_counters = {k: v_ for k, v_ in counters["inductor"].items() if "cudagraph" in k or "partition" in k}
    walls, hosts = [], []
    for i in range(10, 10 + steps):
        walls.append(st.step(i)); hosts.append(st.host_ms)
    # guards alone
    tok = st.stream[:, PROMPT + 5:PROMPT + 6]
    kw = dict(st.kw, position_ids=torch.full((batch, 1), PROMPT + 5, device=DEV))
    with torch.no_grad():
        found = step_guards(st.forward, tok, **kw)
    gus = None
    if found:
        mgr, frame = found
        t0 = time.perf_counter()
        for _ in range(2000): mgr.check(frame)
        gus = (time.perf_counter() - t0) / 2000 * 1e6
    # split the host part: mark_step_begin / full / forward
    parts = {"full": [], "mark": [], "fwd": []}
    with torch.no_grad():
        for i in range(10 + steps, 10 + 2 * steps):
            tok = st.stream[:, PROMPT + i:PROMPT + i + 1]
            sync()
            t0 = time.perf_counter(); torch.compiler.cudagraph_mark_step_begin()
            t1 = time.perf_counter(); pos = torch.full((batch, 1), PROMPT + i, device=DEV)
            t2 = time.perf_counter(); kw = dict(st.kw, position_ids=pos); st.forward(tok, **kw)
            t3 = time.perf_counter(); sync()
            parts["mark"].append(t1 - t0); parts["full"].append(t2 - t1); parts["fwd"].append(t3 - t2)
    prof = cProfile.Profile()
    with torch.no_grad():
        prof.enable()
        for i in range(10 + 2 * steps, 10 + 2 * steps + 100):
            for _ in range(1):
                tok = st.stream[:, PROMPT + i:PROMPT + i + 1]
                torch.compiler.cudagraph_mark_step_begin()
                kw = dict(st.kw, position_ids=torch.full((batch, 1), PROMPT + i, device=DEV))
                st.forward(tok, **kw)
                sync()
        prof.disable()
    s = io.StringIO(); ps = pstats.Stats(prof, stream=s); ps.sort_stats("tottime").print_stats(45)
    stats = {f"{k[0].split('site-packages/')[-1]}:{k[1]}:{k[2]}": (v_[1], v_[2], v_[3]) for k, v_ in ps.stats.items()}
    json.dump(dict(variant=variant, tree=tree, ic=inductor_counters, wall=statistics.median(walls), host=statistics.median(hosts),
                   guards_us=gus, guard_count=None,
                   parts={k: statistics.median(x) * 1e6 for k, x in parts.items()},
                   stats=stats, text=s.getvalue()), open(out, "w"))

if __name__ == "__main__":
    if sys.argv[1] == "child":
        child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]); sys.exit()
    batch, steps = int(sys.argv[1]), int(sys.argv[2])
    res = {}
    for rnd, variant in enumerate(["stock", "patched", "patched", "stock"]):
        out = f"/tmp/ro_{variant}_{rnd}.json"
        subprocess.run([sys.executable, __file__, "child", variant, str(batch), str(steps), out], check=True)
        res.setdefault(variant, []).append(json.load(open(out)))
    for variant, rs in res.items():
        for r in rs:
            print(variant, "tree", r["tree"], "inductor", r["ic"])
            print(f"{variant}: wall {r['wall']:.3f} ms host {r['host']:.3f} ms guards {r['guards_us']:.1f} us parts "
                  + " ".join(f"{k} {v:.1f}" for k, v in r['parts'].items()))
    # function diff (cumtime not, tottime per step)
    n = 100
    keys = set(res["stock"][0]["stats"]) | set(res["patched"][0]["stats"])
    def tt(r, k): return sum(x["stats"].get(k, (0, 0, 0))[1] for x in r) / len(r) / n * 1e6
    def cc(r, k): return sum(x["stats"].get(k, (0, 0, 0))[0] for x in r) / len(r) / n
    rows = sorted(keys, key=lambda k: -abs(tt(res["patched"], k) - tt(res["stock"], k)))
    print("| function | calls/step stock / patched | tottime us/step stock / patched |")
    for k in rows[:30]:
        print(f"| {k[-90:]} | {cc(res['stock'],k):.1f} / {cc(res['patched'],k):.1f} | {tt(res['stock'],k):.2f} / {tt(res['patched'],k):.2f} |")
    print(res["stock"][0]["text"][:6000]); print(res["patched"][0]["text"][:6000])
