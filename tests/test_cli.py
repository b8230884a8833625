"""The ``qkrope`` command line: --version, info, build-native, bench's requests, subsets,
interrupts, help text, and the reduced plan a machine without CUDA checks."""

import itertools
import json
import os
import re
import sys

import pytest
import torch
import triton

import qkrope
from qkrope import cli
from qkrope.bench import impls as bench_impls
from qkrope.bench import runner
from qkrope.cli import main
from qkrope.ops import _native
from qkrope.suite import DEFAULT_MODEL, MODELS, SUITE, Workload

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path of the CLI")


def run(argv, capsys):
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


# ----------------------------------------------------------------------------------------------
# --version, info, build-native
# ----------------------------------------------------------------------------------------------
def test_version_names_qkrope_torch_and_triton(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    out = capsys.readouterr().out.strip()
    assert out == (f"qkrope {qkrope.__version__} (torch {torch.__version__}, "
                   f"triton {triton.__version__})")


def test_info_prints_key_value_lines(capsys):
    rc, out, _ = run(["info"], capsys)
    assert rc == 0
    lines = out.strip().splitlines()
    assert all(re.match(r"^[^:]+: .+$", line) for line in lines), lines
    info = dict(line.split(": ", 1) for line in lines)
    assert info["qkrope version"] == qkrope.__version__
    assert info["torch version"] == torch.__version__
    assert info["Triton version"] == triton.__version__
    assert info["launch route"] == qkrope.ops.launch_route()
    assert info["native status"] == _native.describe()["status"]
    assert info["native enabled"] == str(_native.enabled())
    if torch.cuda.is_available():
        assert info["GPU 0"].startswith(torch.cuda.get_device_name(0))
    else:
        assert info["GPU"] == "none" and info["CUDA available"] == "False"
        assert info["Triton interpreter"].startswith("on (TRITON_INTERPRET=1")
        assert info["launch route"].startswith("interpreter")


def test_info_json_and_native_description(monkeypatch, capsys):
    # _native.describe(): one "native KEY: value" line each.
    monkeypatch.setattr(_native, "describe", lambda: {"cache": "/tmp/ext", "compiler": "c++"})
    rc, out, _ = run(["info", "--json"], capsys)
    data = json.loads(out)
    assert rc == 0 and data["native"] == {"cache": "/tmp/ext", "compiler": "c++"}
    assert data["cuda_available"] is torch.cuda.is_available()
    assert data["launch_route"] == qkrope.ops.launch_route()
    rc, out, _ = run(["info"], capsys)
    assert "native cache: /tmp/ext\n" in out and "native compiler: c++\n" in out


def test_tests_build_the_native_helper_in_a_temporary_cache():
    # tests/conftest.py: the session's own cache unless the user chose one.
    root = os.environ["QKROPE_CACHE_DIR"]
    assert str(_native.cache_path()).startswith(os.path.join(root, "native"))
    if os.path.basename(root).startswith("qkrope-test-cache-"):
        assert not str(_native.cache_path()).startswith(os.path.expanduser("~/.cache"))


def test_info_native_status_agrees_with_the_cache(monkeypatch, capsys):
    # After `qkrope build-native` (another process) the cache holds a verified file that this
    # process has not loaded: "native not built yet" beside "native cached: True" contradicted.
    monkeypatch.setattr(_native, "enabled", lambda: True)
    monkeypatch.setattr(_native, "_state", _native._fresh_state())
    monkeypatch.setattr(_native, "_verified_sha", lambda path: "f00d")
    rc, out, _ = run(["info"], capsys)
    assert rc == 0 and "not built yet" not in out
    assert "native status: python (native built and cached, not loaded" in out
    monkeypatch.setattr(_native, "_verified_sha", lambda path: None)
    rc, out, _ = run(["info"], capsys)
    assert "native status: python (native not built yet" in out


@pytest.mark.parametrize("ok, rc", [(True, 0), (False, 1)])
def test_build_native_reports_path_or_reason(monkeypatch, capsys, ok, rc):
    seen = []

    def build(timeout):
        seen.append(timeout)
        return ok, "/cache/qkrope_native.so" if ok else "no C++ compiler found"

    monkeypatch.setattr(_native, "build", build)
    code, out, _ = run(["build-native", "--timeout", "12.5"], capsys)
    assert code == rc and seen == [12.5]
    assert out == ("native launch helpers: built: /cache/qkrope_native.so\n" if ok else
                   "native launch helpers: not built: no C++ compiler found\n")


# ----------------------------------------------------------------------------------------------
# help
# ----------------------------------------------------------------------------------------------
def _help(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv + ["--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def test_help_is_self_contained(capsys):
    text = _help([], capsys) + _help(["bench"], capsys) + _help(["info"], capsys) \
        + _help(["build-native"], capsys)
    flat = " ".join(text.split())
    assert "SPEC" not in text and "§" not in text
    assert "S new tokens per sequence" in flat
    assert "after C tokens already in the KV cache" in flat
    assert "for a batch of B sequences" in flat
    assert "Correctness rule:" in flat and "at least 99% of the elements" in flat
    assert "Timing protocol" in flat and "median of 50" in flat
    assert "S over 32 becomes 32 + S mod 32, B over 8 becomes 8" in flat  # the CPU plan
    assert "96/8 becomes 6/2" in flat
    assert all(f"{w.seq_len},{w.cache_len},{w.batch}" in text for w in SUITE)
    for command in ("bench", "info", "build-native"):
        assert command in text


def test_every_option_has_help():
    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command").choices
    for p in [parser, *subparsers.values()]:
        for action in p._actions:
            if action.dest != "command":
                assert action.help and len(action.help) > 10, (p.prog, action.dest)


def test_bench_list_prints_the_suite_and_implementations(capsys):
    rc, out, _ = run(["bench", "--list"], capsys)
    assert rc == 0
    for k, w in enumerate(SUITE, 1):
        assert re.search(rf"^\s*{k}\s+{w.seq_len}\s+{w.cache_len}\s+{w.batch}\s+{w.tokens}\s+"
                         rf"{w.atol:g}$", out, re.M)
    for name in bench_impls.ALL_IMPLS:
        assert f"  {name} " in out
    assert "flashinfer" in out and "--layout paged" in out


# ----------------------------------------------------------------------------------------------
# bench: requests checked before any work
# ----------------------------------------------------------------------------------------------
@pytest.fixture
def no_work(monkeypatch):
    """Fails the test if the benchmark starts."""

    def boom(*a, **k):
        raise AssertionError("the benchmark started")

    monkeypatch.setattr(runner, "run_benchmark", boom)
    monkeypatch.setattr("qkrope.bench.run_benchmark", boom)


def test_plot_without_matplotlib_fails_before_any_work(monkeypatch, capsys, no_work, tmp_path):
    # Where a plot will be drawn (a GPU: simulated here, the run itself never starts).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    rc, out, err = run(["bench", "--plot", str(tmp_path / "p.png")], capsys)
    assert rc == 2 and out == ""
    assert err == ("qkrope bench: error: --plot needs matplotlib: pip install 'qkrope[plot]' "
                   "(or drop --plot)\n")


@cpu_only
def test_plot_without_a_gpu_still_checks_and_writes_the_json(capsys, tmp_path):
    rc, out, err = run(["bench", "--shape", "1,0,1", "--plot", str(tmp_path / "p.png"),
                        "--json", str(tmp_path / "r.json")], capsys)
    assert rc == 0 and "| pass |" in out
    assert json.loads((tmp_path / "r.json").read_text())["complete"] is True
    assert not (tmp_path / "p.png").exists()
    flat = " ".join(err.split())  # the console wraps long lines
    assert "p.png not written" in flat and "timing needs a CUDA GPU" in flat


@pytest.mark.parametrize("argv, message", [
    (["--impl", "qkrope,triton"], "--impl: unknown implementation 'triton'"),
    (["--impl", " , "], "--impl: no implementation named"),
    (["--shape", "1,0,1", "--sweep"], "--shape and --sweep both choose the workloads"),
    (["--json", "/no/such/folder/r.json"], "--json /no/such/folder/r.json: folder /no/such/folder"),
    (["--plot", "/no/such/folder/p.png"], "--plot /no/such/folder/p.png: folder /no/such/folder"),
    (["--cache-len", "100", "--layout", "paged"],
     "--cache-len 100: workload 1,0,64 needs a cache of at least 1024 rows"),
    (["--cache-len", "2000", "--shape", "1,2048,4"],
     "--cache-len 2000: workload 1,2048,4 needs a cache of at least 2049 rows"),
    # A paged prefill of B sequences writes B * S token-major rows after C.
    (["--cache-len", "300", "--layout", "paged", "--shape", "128,0,4"],
     "--cache-len 300: workload 128,0,4 needs a cache of at least 512 rows"),
])
def test_bad_requests_exit_two_before_any_work(capsys, no_work, argv, message):
    rc, _, err = run(["bench"] + argv, capsys)
    assert rc == 2 and message in err


def test_default_impls_name_only_what_can_run():
    gpu = bench_impls.default_impls("bhsd", timed=True)
    assert gpu[:3] == ["qkrope", "torch.compile", "eager"] and "flashinfer" not in gpu
    assert ("liger" in gpu) == (bench_impls.IMPLS["liger"].unavailable() is None)
    assert bench_impls.default_impls("paged", timed=True) == ["qkrope", "torch.compile", "eager"]
    assert bench_impls.default_impls("bhsd", timed=False) == ["qkrope"]
    assert "--layout paged" in bench_impls.peer_unavailable("flashinfer")
    assert bench_impls.peer_unavailable("liger", "paged") == "no paged adapter"


# ----------------------------------------------------------------------------------------------
# bench on CPU: subsets, interrupts, the reduced plan
# ----------------------------------------------------------------------------------------------
SUBSETS = [c for n in range(1, len(bench_impls.ALL_IMPLS) + 1)
           for c in itertools.combinations(bench_impls.ALL_IMPLS, n)]


@cpu_only
@pytest.mark.parametrize("subset", SUBSETS, ids=",".join)
def test_every_impl_subset_runs_on_cpu(capsys, tmp_path, subset):
    # One decode token on qwen3-0.6b's heads (reduced to 4/2): the interpreter's smallest job.
    rc, out, _ = run(["bench", "--impl", ",".join(subset), "--shape", "1,7,2",
                      "--model", "qwen3-0.6b", "--json", str(tmp_path / "r.json")], capsys)
    assert rc == 0
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["complete"] is True
    assert set(data["skipped"]) == set(subset) - {"qkrope"}
    for name in set(subset) - {"qkrope"}:
        assert f"- skipped {name}: " in out
    if "flashinfer" in subset:
        assert "- skipped flashinfer: FlashInfer's fused op is token-major" in out
    if "qkrope" in subset:
        assert data["impls"] == ["qkrope"] and out.count("| pass |") == 1
        assert data["workloads"][0]["impls"]["qkrope"]["correct"] is True
    else:
        assert data["impls"] == [] and "Nothing checked" in out


@cpu_only
def test_ctrl_c_exits_130_and_keeps_partial_json(monkeypatch, capsys, tmp_path):
    checks = []
    real_check = runner.check_result

    def check_then_interrupt(*args):
        checks.append(1)
        if len(checks) == 2:  # during the second workload
            raise KeyboardInterrupt
        return real_check(*args)

    monkeypatch.setattr(runner, "check_result", check_then_interrupt)
    path = tmp_path / "partial.json"
    rc, out, err = run(["bench", "--shape", "1,0,1", "--shape", "1,3,2", "--shape", "2,0,1",
                        "--model", "qwen3-0.6b", "--json", str(path)], capsys)
    assert rc == 130 and out == ""
    assert err.strip().splitlines()[-1] == f"interrupted; partial results written to {path}"
    data = json.loads(path.read_text())
    assert data["complete"] is False and len(data["workloads"]) == 1
    assert data["workloads"][0]["impls"]["qkrope"]["correct"] is True


@cpu_only
def test_ctrl_c_without_json_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr(runner, "check_result", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt))
    rc, out, err = run(["bench", "--shape", "1,0,1", "--model", "qwen3-0.6b"], capsys)
    assert rc == 130 and out == "" and err.strip().splitlines()[-1] == "interrupted"
    assert "Traceback" not in err


def test_ctrl_c_in_other_commands_exits_130(monkeypatch, capsys):
    def interrupted(timeout):
        raise KeyboardInterrupt

    monkeypatch.setattr(_native, "build", interrupted)
    rc, _, err = run(["build-native"], capsys)
    assert rc == 130 and err == "interrupted\n"


def test_cpu_plan_covers_every_suite_workloads_shape_class():
    plan = runner.check_plan(SUITE, DEFAULT_MODEL, reduced=True)
    assert plan.reduced and [listed for listed, _ in plan.workloads] == list(SUITE)
    for listed, checked in plan.workloads:
        assert checked.cache_len == listed.cache_len and checked.atol == listed.atol
        assert checked.batch == listed.batch  # no suite batch is cut
        assert (checked.seq_len == 1) == (listed.seq_len == 1)  # decode stays decode
        assert checked.seq_len % 32 == listed.seq_len % 32  # the same partial token tile
        assert checked.seq_len <= listed.seq_len and checked.seq_len < 64
    g = plan.geometry
    assert (g.head_dim, g.rope_theta, g.rms_norm_eps) == (128, 1e7, 1e-6)
    assert (g.num_q_heads, g.num_kv_heads) == (6, 2)
    for model in MODELS.values():
        r = runner.check_plan(SUITE, model, reduced=True).geometry
        assert r.num_q_heads % r.num_kv_heads == 0 and r.num_q_heads > r.num_kv_heads >= 2
        assert r.head_dim == model.head_dim and r.num_q_heads <= model.num_q_heads
    # The interpreter's cost is one unit per (head, token) row of its power-of-two head
    # tiles (~6 ms each on two cores): the plan stays a minute or two of work.
    rows = sum(c.tokens for _, c in plan.workloads) * (triton.next_power_of_2(g.num_q_heads)
                                                       + triton.next_power_of_2(g.num_kv_heads))
    assert rows <= 10_000
    full = runner.check_plan(SUITE, DEFAULT_MODEL, reduced=False)
    assert not full.reduced and full.geometry == DEFAULT_MODEL
    assert all(a == b for a, b in full.workloads)


@cpu_only
def test_default_cpu_bench_runs_the_reduced_suite(monkeypatch, capsys):
    # `qkrope bench` with no arguments on CPU: the suite, qkrope only, reduced (asserted on the
    # call, not by running the whole suite here).
    calls = []

    def record(workloads, geometry, impls, **kw):
        calls.append((list(workloads), geometry, impls, kw))
        raise KeyboardInterrupt  # stop here

    monkeypatch.setattr("qkrope.bench.run_benchmark", record)
    rc, _, err = run(["bench"], capsys)
    assert rc == 130
    (workloads, geometry, impls, kw), = calls
    assert workloads == list(SUITE) and geometry == DEFAULT_MODEL and impls == ["qkrope"]
    assert kw["full_size"] is False
    assert "reduced sizes: 6/2 heads instead of 96/8" in " ".join(err.split())


@cpu_only
def test_cpu_run_cuts_sequence_batch_and_heads_and_says_so(capsys, tmp_path):
    path = tmp_path / "r.json"
    rc, out, _ = run(["bench", "--shape", "65,2,1", "--shape", "1,5,9", "--model", "qwen3-0.6b",
                      "--json", str(path)], capsys)
    assert rc == 0
    assert "| 1 | 65 | 2 | 1 | S=33, 4/2 heads |" in out
    assert "| 2 | 1 | 5 | 9 | B=8, 4/2 heads |" in out
    assert "reduced sizes: 4/2 heads instead of 16/8" in out
    data = json.loads(path.read_text())
    assert data["checked_geometry"]["num_q_heads"] == 4
    assert data["geometry"]["num_q_heads"] == 16
    w1, w2 = data["workloads"]
    assert (w1["seq_len"], w1["checked_seq_len"], w2["batch"], w2["checked_batch"]) == (65, 33, 9, 8)
    assert all(w["impls"]["qkrope"]["correct"] for w in data["workloads"])


@cpu_only
def test_full_flag_checks_full_sizes_on_cpu(capsys, tmp_path):
    path = tmp_path / "r.json"
    rc, out, _ = run(["bench", "--full", "--shape", "2,1,1", "--model", "qwen3-0.6b",
                      "--json", str(path)], capsys)
    assert rc == 0 and "| 1 | 2 | 1 | 1 | full size |" in out and "at full sizes" in out
    assert json.loads(path.read_text())["checked_geometry"] is None


@cpu_only
def test_progress_reports_count_and_weighted_work():
    events = []

    class Record(runner.Progress):
        def start(self, total, count):
            events.append(("start", total, count))

        def done(self, amount):
            events.append(("done", amount))

    ws = [Workload(1, 0, 1), Workload(3, 2, 2)]
    report = runner.run_benchmark(ws, MODELS["qwen3-0.6b"], ["qkrope"], progress=Record())
    assert report.complete and len(report.workloads) == 2
    (_, total, count), *dones = events
    assert count == 2 and [e[0] for e in dones] == ["done", "done"]
    assert sum(e[1] for e in dones) == pytest.approx(total)
    assert dones[1][1] > dones[0][1]  # six tokens weigh more than one


def test_bench_waits_for_the_native_helpers_at_most_the_bound(monkeypatch):
    # The GPU path's wait (issue 16 item 3), without a GPU: everything after it stubbed out.
    waits = []
    monkeypatch.setattr(runner.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_native, "enabled", lambda: True)
    monkeypatch.setattr(_native, "module", lambda: None)
    monkeypatch.setattr(_native, "load", lambda timeout=None, force=False: waits.append(timeout))

    class Stop(Exception):
        pass

    def stop(*a, **k):
        raise Stop

    from qkrope.bench import timing

    monkeypatch.setattr(timing, "copy_bandwidth", stop)
    with pytest.raises(Stop):
        runner.run_benchmark([Workload(1, 0, 1)], impls=["eager"], native_wait_s=42.0)
    assert waits == [42.0]
    waits.clear()
    with pytest.raises(Stop):
        runner.run_benchmark([Workload(1, 0, 1)], impls=["eager"], native_wait_s=0)
    assert waits == []


# ----------------------------------------------------------------------------------------------
# bench: paths, seeds and sizes it cannot use
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("opt", ["--json", "--plot"])
def test_output_path_that_is_a_folder_fails_before_any_work(capsys, no_work, tmp_path, opt):
    if opt == "--plot":
        pytest.importorskip("matplotlib")
        if not torch.cuda.is_available():
            pytest.skip("--plot without a GPU is refused for that first")
    rc, out, err = run(["bench", opt, str(tmp_path)], capsys)
    assert rc == 2 and out == ""
    assert err == f"qkrope bench: error: {opt} {tmp_path}: is a folder; give a file name\n"
    assert list(tmp_path.parent.glob(tmp_path.name + ".tmp")) == []


def test_write_json_leaves_no_stray_tmp_file(tmp_path):
    report = runner.BenchReport(model="m", geometry={}, timed=False, copy_bandwidth=None,
                                impls=[], skipped={}, add_host_us=None, workloads=[],
                                environment={}, settings={})
    target = tmp_path / "r.json"
    target.mkdir()  # os.replace onto a folder fails
    with pytest.raises(OSError):
        runner.write_json(report, target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


@pytest.mark.parametrize("seed", [str(10**23), str(2**64), str(-2**63 - 1)])
def test_seed_torch_cannot_take_is_a_usage_error(capsys, no_work, seed):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--seed", seed])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    assert err.splitlines()[-1] == (f"qkrope bench: error: argument --seed: wants an integer "
                                    f"from -2**63 to 2**64 - 1 (the seeds torch's generator "
                                    f"takes), got {seed}")


@pytest.mark.parametrize("argv, shrink", [
    (["--cache-len", "100000000000"], "use a smaller --cache-len"),
    (["--shape", "1,3000000000,1"], "use a smaller C or B in --shape"),
    (["--cache-len", "100000000000", "--layout", "paged", "--shape", "1,0,2"],
     "use a smaller --cache-len"),
])
def test_cache_too_big_for_this_machine_is_a_usage_error(capsys, no_work, argv, shrink):
    rc, out, err = run(["bench", "--model", "qwen3-0.6b"] + argv, capsys)
    assert rc == 2 and out == "" and len(err.splitlines()) == 1, err
    assert err.startswith("qkrope bench: error: workload ") and "key and value caches of" in err
    assert "bfloat16 each" in err and err.rstrip().endswith(shrink)


@cpu_only
def test_inputs_that_fail_to_allocate_say_what_and_how_to_shrink(monkeypatch, capsys, tmp_path):
    # Memory the check before the run did not see (here: not told): the allocation fails in
    # the run, and the command says what it tried, in one line, with no traceback.
    monkeypatch.setattr(runner, "memory_bytes", lambda: None, raising=False)
    path = tmp_path / "r.json"
    rc, out, err = run(["bench", "--model", "qwen3-0.6b", "--cache-len", "100000000000",
                        "--shape", "1,0,1", "--json", str(path)], capsys)
    last = err.strip().splitlines()[-1]
    assert rc == 1 and out == "" and "Traceback" not in err
    assert last.startswith("qkrope bench: error: workload 1,0,1: could not allocate its inputs "
                           "(about 279.4 TiB: key and value caches of [1, 2, 100000000000, 128]")
    assert "use a smaller cache length (--cache-len) or workload (--shape S,C,B)" in last
    assert last.endswith(f"; partial results written to {path}")
    assert json.loads(path.read_text())["complete"] is False


def test_e2e_cpu_path_checks_the_patched_model_and_its_graphs(tmp_path, capsys):
    # What CI can run of `qkrope bench --e2e`: a tiny model through the interpreter, stock vs
    # patched; the patched logits must be the stock ones bit for bit in eager mode (here, in
    # the interpreter), and the compiled decode step one graph each for stock and patched, no
    # break, no recompile after warm-up.
    if torch.cuda.is_available():
        pytest.skip("the CPU path (a GPU times the full presets)")
    path = tmp_path / "e2e.json"
    rc, out, err = run(["bench", "--e2e", "--batch", "2", "--modes", "eager,compile",
                        "--phases", "decode", "--json", str(path)], capsys)
    assert rc == 0, (out, err)
    assert "Timing needs a CUDA GPU" in err and "| qwen3-8b | 2 | decode | compile |" in out
    cells = {c["mode"]: c for c in json.loads(path.read_text())["cells"]}
    assert cells["eager"]["patched_dev"] == 0.0 and cells["eager"]["correct"] is True
    assert cells["compile"]["correct"] is True
    assert (cells["compile"]["graphs"], cells["compile"]["graph_breaks"],
            cells["compile"]["recompiles_after_warmup"]) == (2, 0, 0)
    assert all(c["stock_ms"] is None and c["stock_times"] is None and c["error"] is None
               and c["stock_host_ms"] is None and c["patched_host_times"] is None
               for c in cells.values())


def test_e2e_workers_report_errors_and_deaths_instead_of_hanging():
    # Each variant runs in a worker process of its own: a request that fails comes back as the
    # cell's error line, a worker that dies is reported at once (no wait on a dead pipe), and
    # the run leaves no process behind.
    import multiprocessing

    from qkrope.bench.e2e import WorkerError, _Worker, run_e2e

    report = run_e2e(["no-such-preset"], [1], ["eager"], ["decode"], layers=1, steps=1,
                     warmup=1)
    assert report.cells[0].error == "KeyError: 'no-such-preset'"
    assert not multiprocessing.active_children()
    w = _Worker("stock", "qwen3-8b", 1, "cpu", 0, 0.0)
    try:
        route, digest = w.result()  # ready: its launch route, its weights' digest
        assert route.startswith("python") and len(digest) > 4
        # A timed block gives each step's wall time and its host part (until the forward
        # returned), which is never longer.
        from qkrope.bench.e2e import PROMPT, TINY_VOCAB
        w.call("setup", "eager", "decode", torch.randint(0, TINY_VOCAB, (1, PROMPT + 3)), 1)
        steps = w.call("block", 1, 3, None)
        assert len(steps) == 2 and all(0 < host <= wall for wall, host in steps), steps
        w.proc.kill()
        with pytest.raises(WorkerError, match="the stock worker died"):
            w.call("block", 0, 1, None)
    finally:
        w.close()
    assert not multiprocessing.active_children()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no thread affinity here")
def test_e2e_timing_pins_a_thread_to_one_core_and_back():
    # Both workers time on one core (the parent's last), each pinned for its timed steps and
    # back on every core for the next compile (docs/design.md, "End-to-end bench").
    from qkrope.bench.e2e import _pin, _timing_core

    before = os.sched_getaffinity(0)
    core = _timing_core()
    assert core == max(before)
    try:
        _pin(core)
        assert os.sched_getaffinity(0) == {core}
    finally:
        _pin(None)
    assert os.sched_getaffinity(0) == before


def test_e2e_usage_errors(capsys):
    for argv, what in ((["--model", "qwen3-coder-480b"], "--e2e --model"),
                       (["--layout", "paged"], "do not apply"),
                       (["--rescore", "/nonexistent/e2e.json"], "--rescore /nonexistent"),
                       (["--rescore", "x.json", "--batch", "1"], "--batch do not apply")):
        rc, _, err = run(["bench", "--e2e", *argv], capsys)
        assert rc == 2 and what in err


def test_e2e_rescore_reads_a_saved_run_with_todays_statistics(tmp_path, capsys):
    # `qkrope bench --rescore FILE` runs nothing: it rebuilds a saved run's table from the
    # step times in its JSON, so a committed result reads as today's statistics report it.
    # Here a file whose figures (as written then) are stale: the table and the new JSON carry
    # the block medians; an untimed cell (an error) passes through.
    from qkrope.bench.e2e import Cell, E2EReport, block_median, write_e2e_json

    stock = [4.7, 4.3] * 6
    patched = [4.65, 4.25] * 6
    timed = Cell("qwen3-8b", 1, "prefill", "compile", stock_ms=9.0, patched_ms=9.0,
                 stock_times=stock, patched_times=patched, stock_dev=0.1, patched_dev=0.05,
                 allowed_dev=0.3, graphs=2, graph_breaks=0, recompiles_after_warmup=0)
    failed = Cell("qwen3-8b", 1, "decode", "eager", error="CUDA error: out of memory")
    src, dst = tmp_path / "run.json", tmp_path / "rescored.json"
    write_e2e_json(E2EReport(environment={"gpu": "NVIDIA H100", "torch": "2.11"}, layers=4,
                             timed=True, cells=[timed, failed]), src)
    rc, out, err = run(["bench", "--rescore", str(src), "--json", str(dst)], capsys)
    assert rc == 1, (out, err)  # the failed cell
    ratio = block_median(stock, 2) / block_median(patched, 2)
    assert f"| 4.500 | 4.450 | {ratio:.2f}×" in out and "gpu NVIDIA H100" in out
    assert "error: CUDA error: out of memory" in out
    assert "Speed-up ≥ 1.0 in 1 of 1 timed cells; 95% intervals: 1 wholly above 1.0, 0 holding" \
        in out
    cells = json.loads(dst.read_text())["cells"]
    assert cells[0]["block"] == 2 and cells[0]["speedup"] == pytest.approx(ratio)
    assert cells[0]["correct"] is True and cells[1]["stock_ms"] is None
    # a JSON of another command, or no JSON at all: refused, naming the argument
    for text in ('{"workloads": []}', "not json"):
        (tmp_path / "other.json").write_text(text)
        rc, _, err = run(["bench", "--rescore", str(tmp_path / "other.json")], capsys)
        assert rc == 2 and "--rescore" in err and "qkrope bench --e2e --json" in err, err


class _FakeWorker:
    """A stand-in for an e2e worker process: answers the parent's requests from fixed
    figures (a step of ``wall`` ms, its host part half of it) and records them."""

    log = []  # (variant, wall) of every block and generate() round, all stand-ins, in order

    def __init__(self, variant, wall, dev=0.0, graphs=1):
        self.variant, self.preset, self.wall = variant, "p", wall
        self.dev, self.graphs, self.calls, self._reply = dev, graphs, [], None

    def send(self, name, *args):
        self.calls.append((name, args[:3] if name == "block" else args[:2]))
        if name in ("block", "generate_round"):
            self.log.append((self.variant, self.wall))
        if name == "reference":
            self._reply = ([torch.zeros(1, 4)] * 2, torch.zeros(1))  # logits, first token
        elif name == "block":
            start, stop = args[:2]
            self._reply = [(self.wall, self.wall / 2)] * (stop - start)
        elif name == "generate_round":
            self._reply = self.wall
        elif name == "finish":
            self._reply = ([torch.full((1, 4), self.dev)] * 2, torch.zeros(1), self.graphs, 0, 0)
        else:
            self._reply = None

    def result(self):
        return self._reply

    def call(self, name, *args):
        self.send(name, *args)
        return self.result()


def test_e2e_several_processes_per_variant_take_turns_and_pool():
    # With two processes per variant (the GPU default), every process of a variant runs every
    # decode block (a decode step builds on the cache the steps before it wrote), prefill
    # blocks go to the processes in turn, the times are pooled, and the interval resamples
    # the processes: a process whose host is slower than its twin's widens it. Deviations and
    # graph counts are the worst of a variant's processes.
    from qkrope.bench.e2e import BLOCK, PREFILL_BLOCK, PREFILL_MOST, Cell, _measure, prefill_steps

    def run(phase, mode, walls):
        workers = {"stock": [_FakeWorker("stock", walls[0]), _FakeWorker("stock", walls[1])],
                   "patched": [_FakeWorker("patched", walls[2], dev=0.25),
                               _FakeWorker("patched", walls[3], dev=0.5, graphs=3)]}
        cell = Cell("p", 1, phase, mode)
        _measure(workers, cell, torch.zeros(1, 8, dtype=torch.long), 40, 5, "cuda", {})
        return cell, workers

    _FakeWorker.log.clear()
    cell, workers = run("decode", "compile", (1.0, 1.1, 0.9, 0.95))
    for w in (w for ws in workers.values() for w in ws):
        blocks = [args[:2] for name, args in w.calls if name == "block"]
        assert blocks == [(s, min(45, s + BLOCK)) for s in range(5, 45, BLOCK)], blocks
    # each process pair runs both orders: the first of a pair alternates from turn to turn
    pairs = [_FakeWorker.log[i:i + 2] for i in range(0, len(_FakeWorker.log), 2)]
    assert [{v for v, _ in p} for p in pairs] == [{"stock", "patched"}] * 8
    assert [p[0] for p in pairs] == [("stock", 1.0), ("stock", 1.1), ("patched", 0.9),
                                     ("patched", 0.95)] * 2
    cell, workers = run("decode", "compile", (1.0, 1.0, 0.9, 0.9))
    assert len(cell.stock_times) == len(cell.patched_times) == 2 * 40
    assert cell.speedup == pytest.approx(1 / 0.9) and cell.stock_host_ms == 0.5
    assert cell.speedup_interval == pytest.approx((1 / 0.9, 1 / 0.9))
    assert (cell.stock_dev, cell.patched_dev) == (0.0, 0.5)
    assert (cell.graphs, cell.graph_breaks, cell.recompiles_after_warmup) == (1 + 3, 0, 0)
    # one reference, from the first stock process
    assert [n for n, _ in workers["stock"][0].calls].count("reference") == 1
    assert "reference" not in [n for n, _ in workers["stock"][1].calls]

    # prefills of 1 ms: blocks while under the time budget, up to PREFILL_MOST, the processes
    # in turn, each pair of them in both orders
    _FakeWorker.log.clear()
    cell, workers = run("prefill", "eager", (1.0, 1.0, 0.9, 0.9))
    got = [[args[:2] for name, args in w.calls if name == "block"] for w in workers["stock"]]
    every = [(s, s + PREFILL_BLOCK) for s in range(2, 2 + PREFILL_MOST, PREFILL_BLOCK)]
    assert got == [every[0::2], every[1::2]] and len(cell.stock_times) == PREFILL_MOST
    firsts = [_FakeWorker.log[i][0] for i in range(0, len(_FakeWorker.log), 2)]
    assert firsts[:8] == ["stock", "stock", "patched", "patched"] * 2
    # prefills of 600 ms: the fewest (prefill_steps), rounded up to whole turns of blocks
    cell, workers = run("prefill", "compile", (600.0, 600.0, 590.0, 590.0))
    n = prefill_steps(40)  # 13: 7 blocks, then an 8th for the second process's 4th
    assert len(cell.stock_times) == len(cell.patched_times) == 16 and n == 13
    assert [len([1 for name, _ in w.calls if name == "block"]) for w in workers["patched"]] == \
        [4, 4]

    _FakeWorker.log.clear()
    cell, workers = run("decode", "generate", (1.0, 1.1, 0.9, 0.95))
    rounds = [sum(n == "generate_round" for n, _ in w.calls) for w in workers["patched"]]
    assert sum(rounds) == 15 and min(rounds) == 7
    # the processes take the rounds in turn, and each process pair runs both orders
    pairs = [_FakeWorker.log[i:i + 2] for i in range(0, 30, 2)]
    assert [p[0][1] in (1.0, 0.9) for p in pairs] == [True, False] * 7 + [True]
    assert [p[0][0] for p in pairs][:4] == ["stock", "stock", "patched", "patched"]

    # the second patched process runs 20% slower than the first: the interval shows it
    cell, _ = run("decode", "compile", (1.0, 1.0, 0.9, 1.08))
    lo, hi = cell.speedup_interval
    assert lo < 1 / 1.08 * 1.01 and hi > 1 / 0.9 * 0.99


def test_e2e_speedup_interval_brackets_the_ratio_and_widens_with_noise():
    import random
    import statistics

    from qkrope.bench.e2e import speedup_interval

    rng = random.Random(1)
    drift = [1 + 0.3 * (i / 40) for i in range(40)]  # the machine slows down: both variants
    stock = [2.0 * d * (1 + 0.01 * rng.random()) for d in drift]
    patched = [1.6 * d * (1 + 0.01 * rng.random()) for d in drift]
    lo, hi = speedup_interval(stock, patched)
    point = statistics.median(stock) / statistics.median(patched)
    assert lo <= point <= hi and 1.2 < lo and hi < 1.3
    noisy = [p * (1 + 0.2 * rng.random()) for p in patched]
    lo2, hi2 = speedup_interval(stock, noisy)
    assert hi2 - lo2 > hi - lo
    assert speedup_interval(stock, stock) == (1.0, 1.0)
    assert speedup_interval([1.0, 2.0], [1.0, 2.0]) is None  # too few pairs to resample
    # A burst of host load slows a whole block of one variant (here 1 of patched's 4 blocks of
    # 10): resampled by blocks, the interval shows that the steps were not independent.
    burst = [p * (1.5 if 10 <= i < 20 else 1.0) for i, p in enumerate(patched)]
    lo3, hi3 = speedup_interval(stock, burst)
    lo4, hi4 = speedup_interval(stock, burst, block=10)
    assert lo4 < lo3 and hi4 - lo4 > 2 * (hi3 - lo3)
    assert speedup_interval(stock, burst, block=20) is None  # 2 blocks: too few to resample
    # Two processes per variant (run k in process k % 2): one process of patched ran slower
    # for its whole life; resampled by process first, the interval holds both processes'
    # ratios, where resampled by runs alone it would not.
    slow = [p * (1.1 if (i // 2) % 2 else 1.0) for i, p in enumerate(patched)]
    lo5, hi5 = speedup_interval(stock, slow, block=2, processes=2)
    lo6, hi6 = speedup_interval(stock, slow, block=2)
    assert lo5 < lo6 and hi6 < hi5 and lo5 < 1.25 / 1.1 and hi5 > 1.25
    assert speedup_interval(stock, stock, block=5, processes=2) == (1.0, 1.0)
    assert speedup_interval(stock, slow, block=5, processes=4) is None  # 2 runs a process


def test_e2e_figure_is_the_median_of_block_medians():
    # Prefills run in blocks of 2 per variant, and the first of a block pays for the switch
    # from the other variant (~8% here, both variants alike): the pooled steps are bimodal,
    # half and half, and their median falls in the gap, set by the slowest settled step and
    # the fastest switching one. Patched is 1% faster at both positions of every block; one
    # settled patched step was slow. The pooled medians read patched slower; each block's
    # median (of 2: their mean), then the median over blocks, reads the 1%, and the interval
    # resamples the same blocks.
    import statistics

    from qkrope.bench.e2e import block_median, speedup_interval

    stock, patched = [], []
    for k in range(10):
        jitter = 0.002 * k
        stock += [4.70 + jitter, 4.30 + jitter]
        patched += [(4.70 + jitter) / 1.01, (4.30 + jitter) / 1.01]
    patched[9] = 4.50  # block 5's settled step: a burst
    stock[10] = 4.52   # block 6's switching step: the fastest of stock's
    assert statistics.median(stock) / statistics.median(patched) < 1.0
    point = block_median(stock, 2) / block_median(patched, 2)
    assert point == pytest.approx(1.01, abs=2e-3)
    lo, hi = speedup_interval(stock, patched, block=2)
    assert lo <= point <= hi and lo > 1.0
    assert block_median([3.0, 1.0, 2.0], 1) == 2.0  # one step a block: the plain median
    assert block_median([1.0, 3.0, 5.0, 9.0, 4.0], 2) == 4.0  # (2, 7, 4): a short last block
    # blocks of 10 (decode): a block's slow first step (the switch) does not move its median
    assert block_median([9.0] + [1.0] * 9 + [9.0] + [2.0] * 9 + [9.0] + [3.0] * 9, 10) == 2.0
