"""Benchmark machinery on plain data (no GPU needed): call splitting, statistics, rendering,
JSON, the plot, and the CLI's CPU path."""

import json
import math

import pytest
import torch

from qkrope.bench.report import BenchReport, ImplResult, WorkloadResult, render_markdown, \
    write_json, write_plot
from qkrope.bench.runner import sweep_workloads
from qkrope.bench.timing import FLUSH_KERNEL_NAME, KernelRecord, split_calls, summarize
from qkrope.cli import main
from qkrope.suite import SUITE, bytes_moved


def test_split_calls_spans_first_start_to_last_end_including_gaps():
    F = FLUSH_KERNEL_NAME
    recs = [
        KernelRecord(F, 0, 100), KernelRecord("a", 200, 210), KernelRecord("b", 230, 250),
        KernelRecord(F, 300, 400), KernelRecord("a", 500, 503),
        KernelRecord(F, 600, 700), KernelRecord("memset", 710, 711), KernelRecord("a", 720, 730),
    ]
    assert split_calls(list(reversed(recs))) == [0.05, 0.003, 0.02]


def test_split_calls_rejects_a_call_without_gpu_work():
    F = FLUSH_KERNEL_NAME
    with pytest.raises(RuntimeError, match="call 0"):
        split_calls([KernelRecord(F, 0, 1), KernelRecord(F, 2, 3), KernelRecord("a", 4, 5)])


def test_summarize_order_statistics():
    s = summarize([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (s.median, s.p20, s.p80, s.n) == (3.0, 1.8, 4.2, 5)
    with pytest.raises(ValueError):
        summarize([])


def test_bytes_model_matches_spec():
    # docs/spec.md §4: 59,392 B per token for 96/8/128 plus 16 B of indices.
    assert bytes_moved(SUITE[0]) == 59392 + 16
    assert bytes_moved(SUITE[12]) == 4096 * (59392 + 16)


def test_sweep_covers_one_to_16384_tokens():
    ws = sweep_workloads()
    tokens = sorted({w.tokens for w in ws})
    assert tokens[0] == 1 and tokens[-1] == 16384
    assert any(w.seq_len == 1 and w.batch > 1 for w in ws)


def fake_report(timed=True):
    ws = []
    for i, (w, t) in enumerate(zip(SUITE[:3], (2.0, 3.0, 6.0)), 1):
        impls = {
            "qkrope": ImplResult(True, 1.0, 0.0, t, t * 0.9, t * 1.1, 9.0, t * 0.8,
                                 host_add_ratio=0.9),
            "eager": ImplResult(True, 1.0, 0.0, 100 * t, 90 * t, 110 * t, 300.0, None),
        }
        ws.append(WorkloadResult(i, w.seq_len, w.cache_len, w.batch, w.atol, w.tokens,
                                 bytes_moved(w), 1.0 if timed else None, impls,
                                 1.5 if timed else None))
    return BenchReport("qwen3-coder-480b", {"num_q_heads": 96, "num_kv_heads": 8,
                                            "head_dim": 128}, timed, 4.25e12 if timed else None,
                       ["qkrope", "eager"], {"liger": "liger-kernel is not installed"},
                       10.0 if timed else None, ws,
                       {"gpu": "NVIDIA H200", "torch": "x", "triton": "y", "qkrope": "z"},
                       {"iters": 50})


def test_render_markdown_table_and_geomean():
    rep = fake_report()
    text = render_markdown(rep)
    assert math.isclose(rep.geomean("qkrope"), (2 * 3 * 6) ** (1 / 3))
    assert "| 1 | 1 | 0 | 1 | 1 | 1.00 | 1.50 | 2.00 | 1.80–2.20 | 50% | 75% | 1% |" in text
    assert rep.copy_geomean() == pytest.approx(1.5)
    assert "copy of the same bytes 1.50" in text
    assert "100.0×" in text and "skipped liger: liger-kernel is not installed" in text
    assert f"qkrope {rep.geomean('qkrope'):.2f}" in text
    assert "add_ alone took 10.0 µs" in text
    assert "| 1 | 1 | 9.0 | 0.90 | 300.0 | — | 1.60 | — |" in text  # host, × add_, graph


def test_json_and_plot(tmp_path):
    rep = fake_report()
    write_json(rep, tmp_path / "r.json")
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["workloads"][2]["impls"]["qkrope"]["median_us"] == 6.0
    assert data["geomean_us"]["qkrope"] == pytest.approx(rep.geomean("qkrope"))
    write_plot(rep, tmp_path / "r.png")
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path of the CLI")
def test_cli_on_cpu_checks_through_interpreter_and_exits_zero(capsys, tmp_path):
    rc = main(["bench", "--shape", "5,3,2", "--shape", "1,0,1", "--json", str(tmp_path / "o.json")])
    out = capsys.readouterr().out
    assert rc == 0
    assert "Timing needs a CUDA GPU" in out and "| 1 | 5 | 3 | 2 | 6/2 heads | 1e-05 |" in out
    assert "Launch route: interpreter" in out
    assert out.count("| pass |") == 2
    data = json.loads((tmp_path / "o.json").read_text())
    assert data["timed"] is False and data["complete"] is True
    assert data["workloads"][0]["impls"]["qkrope"]["correct"] is True
    assert data["checked_geometry"]["num_q_heads"] == 6
    assert data["environment"]["launch_route"].startswith("interpreter")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path of the CLI")
def test_cli_paged_layout_on_cpu(capsys):
    rc = main(["bench", "--layout", "paged", "--shape", "1,0,6", "--shape", "9,4,1",
               "--model", "qwen3-0.6b"])
    out = capsys.readouterr().out
    assert rc == 0 and "layout paged" in out and out.count("| pass |") == 2


def test_same_bytes_copies_move_the_bytes():
    # The yardstick copies (timed on the GPU) must really copy; here through the interpreter.
    from qkrope.bench.timing import COPY_BLOCK, same_bytes_copies

    src, dst, copies = same_bytes_copies(10_000, device="cuda" if torch.cuda.is_available()
                                         else "cpu")
    assert src.numel() % COPY_BLOCK == 0 and 2 * src.numel() * src.element_size() >= 10_000
    assert set(copies) == {"torch copy_", "triton copy"}
    for copy in copies.values():
        dst.fill_(float("nan"))
        copy()
        assert torch.equal(dst, src)



def test_host_time_is_the_median_run(monkeypatch):
    # 5 runs of 2 calls; one run disturbed (50 µs instead of 1 µs) must not move the figure.
    from qkrope.bench import timing

    monkeypatch.setattr(timing.torch.cuda, "synchronize", lambda: None)
    clock = iter(t * 1e-6 for t in (0, 1, 1, 2, 2, 52, 52, 53, 53, 54))  # start/end of each run
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(clock))
    calls = []
    us = timing.host_time_per_call_us(lambda: calls.append(1), calls=10, batches=5)
    assert len(calls) == 10 + 10  # warm-up calls (min(calls, 20)), then 5 runs of 2
    assert us == pytest.approx(0.5)  # 1 µs per undisturbed run of 2 calls


def test_host_time_beside_a_reference_alternates_runs(monkeypatch):
    # 3 runs each of ref (r) and fn (f), alternating r f r f r f; the host slows down 3x during
    # the second pair: the ratio of each pair stays 2, so the median ratio is 2.
    from qkrope.bench import timing

    monkeypatch.setattr(timing.torch.cuda, "synchronize", lambda: None)
    ends = [1, 3, 6, 12, 13, 15]  # run durations (µs): r=1 f=2 | r=3 f=6 | r=1 f=2
    clock = iter(t * 1e-6 for e0, e1 in zip([0] + ends, ends) for t in (e0, e1))
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(clock))
    order = []
    fn_us, ref_us, ratio = timing.host_times_beside_us(lambda: order.append("f"),
                                                       lambda: order.append("r"),
                                                       calls=3, batches=3)
    assert order[:6] == ["r", "f"] * 3  # warm-up, alternating
    assert order[6:] == ["r", "f"] * 3  # one call per run, reference first
    assert (fn_us, ref_us, ratio) == (pytest.approx(2), pytest.approx(1), pytest.approx(2))


def test_render_without_qkrope_compares_with_the_first_that_ran():
    # A GPU run of `--impl eager` (no qkrope in the list): eager is the main column.
    rep = fake_report()
    for w in rep.workloads:
        del w.impls["qkrope"]
    rep.impls = ["eager"]
    text = render_markdown(rep)
    assert "| eager µs |" in text and "| 1 | 1 | 0 | 1 | 1 | 1.00 | 1.50 | 200.00 |" in text
    assert "qkrope µs" not in text


def test_render_cpu_report_without_qkrope_and_unchecked_results():
    # The CPU crash of `--impl eager` (issue 12 item 8): a result with no verdict renders.
    rep = fake_report(timed=False)
    rep.impls, rep.skipped = [], {"eager": "checked and timed only on a CUDA GPU"}
    for w in rep.workloads:
        w.impls = {}
    text = render_markdown(rep)
    assert "Nothing checked" in text and "- skipped eager: checked and timed only" in text
    rep = fake_report(timed=False)
    rep.workloads[0].impls["qkrope"] = ImplResult()
    assert "| 1 | 1 | 0 | 1 | full size | 1e-05 | — | — | — |" in render_markdown(rep)


def test_partial_report_says_so(tmp_path):
    rep = fake_report(timed=False)
    rep.complete = False
    assert "Partial results: the run stopped after 3 workload(s)." in render_markdown(rep)
    write_json(rep, tmp_path / "p.json")
    assert json.loads((tmp_path / "p.json").read_text())["complete"] is False
    assert not (tmp_path / "p.json.tmp").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path of the CLI")
def test_cli_exits_one_on_a_wrong_qkrope_result(monkeypatch, capsys):
    # A kernel that skipped the norm on one query element fails the command, not just the row.
    from qkrope.bench import impls
    from qkrope.ops.qknorm_rope.reference import qknorm_rope_cache_ref

    def wrong(*args):
        q, k, kc, vc = qknorm_rope_cache_ref(*args)
        q = q.clone()
        q.view(-1)[: q.numel() // 50] += 1.0  # 2% of the elements off: below the 99% rule
        return q, k, kc, vc

    monkeypatch.setitem(impls.IMPLS, "qkrope", impls.Impl("qkrope", "wrong", lambda: wrong))
    assert main(["bench", "--shape", "3,1,1", "--model", "qwen3-0.6b"]) == 1
    assert "FAIL (98.0%)" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path of the CLI")
@pytest.mark.parametrize("wrong, says", [
    # a cache left unreturned (and unwritten): the rule would skip a None
    (lambda q, k, kc, vc, a: (q, k, None, None), "key_cache_out is NoneType"),
    # fp32 outputs of an extra dim: the rule compares in fp32 and would broadcast
    (lambda q, k, kc, vc, a: (q.float()[None], k, kc, vc), "query_rotated is torch.float32"),
    # the rotated rows written over the caller's query
    (lambda q, k, kc, vc, a: (a[0].copy_(q), k, kc, vc), "changed its input argument 0"),
    # one element of a row no token names (row 0: C = 1), far under the rule's 1%
    (lambda q, k, kc, vc, a: (q, k, kc.index_fill_(2, torch.tensor([0]), 7.0), vc),
     "it changed key_cache rows that no token of the call names"),
])
def test_the_bench_gate_refuses_malformed_outputs_and_changed_inputs(monkeypatch, capsys,
                                                                      wrong, says):
    from qkrope.bench import impls
    from qkrope.ops.qknorm_rope.reference import qknorm_rope_cache_ref

    def impl(*args):
        return wrong(*qknorm_rope_cache_ref(*args, inplace=True), args)

    monkeypatch.setitem(impls.IMPLS, "qkrope", impls.Impl("qkrope", "wrong", lambda: impl))
    assert main(["bench", "--shape", "3,1,2", "--model", "qwen3-0.6b"]) == 1
    assert says in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path of the bench")
def test_every_round_of_fresh_inputs_is_checked(monkeypatch):
    # spec.md §2: 10 rounds of fresh random inputs per workload (1 through the interpreter by
    # default); an implementation wrong only on its third call fails the workload.
    from qkrope.bench import impls
    from qkrope.bench.runner import run_benchmark
    from qkrope.ops.qknorm_rope.reference import qknorm_rope_cache_ref
    from qkrope.suite import MODELS, Workload

    calls = []

    def late(*args):
        calls.append(1)
        q, k, kc, vc = qknorm_rope_cache_ref(*args, inplace=True)
        return (q + 1 if len(calls) == 3 else q), k, kc, vc

    monkeypatch.setitem(impls.IMPLS, "qkrope", impls.Impl("qkrope", "late", lambda: late))
    w = Workload(2, 1, 1, 1e-5)
    report = run_benchmark([w], MODELS["qwen3-0.6b"], check_rounds=3)
    assert len(calls) == 3 and report.settings["check_rounds"] == 3
    assert report.workloads[0].impls["qkrope"].correct is False
    calls.clear()
    assert run_benchmark([w], MODELS["qwen3-0.6b"], check_rounds=2).workloads[0] \
        .impls["qkrope"].correct and len(calls) == 2


@pytest.mark.parametrize("layout", ["bhsd", "paged"])
def test_rows_kept_compares_every_row_no_token_names(monkeypatch, layout):
    from qkrope.bench import runner

    monkeypatch.setattr(runner, "SLAB_BYTES", 100)  # a few rows a slab: the slabs' seams too
    shape = (2, 3, 10, 4) if layout == "bhsd" else (5, 2, 3, 4)  # 10 rows or slots either way
    cache = torch.randn(shape).to(torch.bfloat16)
    rows = torch.tensor([3, 7, -1, 12])  # -1 and 12: named by no row of the cache
    args = (None,) * 4 + (cache, cache.clone(), rows)

    def row(t, r):  # a row (bhsd) or a slot (paged) of t
        return t[:, :, r] if layout == "bhsd" else t.flatten(0, 1)[r]

    for r in range(10):
        after = [cache.clone(), cache.clone()]
        row(after[1], r).add_(1)
        call = (None,) * 4 + (*after, rows)
        if r in (3, 7):
            runner._rows_kept(layout, args, call, {})
        else:
            with pytest.raises(ValueError, match="it changed value_cache rows"):
                runner._rows_kept(layout, args, call, {})


def test_fresh_arguments_are_copies_of_the_same_views():
    from qkrope.bench.impls import fresh_arguments

    base = torch.arange(24.0).view(4, 6)
    expanded = torch.arange(3)[None].expand(4, 3)  # the suite's positions: batch stride 0
    view = base[:, 1:4].t()
    copies = fresh_arguments((view, expanded, 1e-6))
    for a, c in zip((view, expanded), copies):
        assert torch.equal(a, c) and a.stride() == c.stride()
        assert a.untyped_storage().data_ptr() != c.untyped_storage().data_ptr()
    copies[0].fill_(-1)
    assert torch.equal(view, base[:, 1:4].t()) and base.min() == 0
    assert copies[2] == 1e-6


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path of the CLI")
@pytest.mark.parametrize("target", ["codes", "scales"])
def test_per_token_head_gate_sees_rows_that_must_stay(monkeypatch, capsys, target):
    # The rows before the new tokens (C = 64 of them): neither their codes nor their scales
    # may change (the scale caches start at 0.75, so such rows also dequantise to values).
    from qkrope.bench import impls
    from qkrope.ops.qknorm_rope.api import fused_rope_with_qk_norm_and_kv_cache_update as op

    def wrong(*args, **kw):
        out = op(*args, **kw)
        if target == "codes":
            out[3][:, :, 5].view(torch.uint8).fill_(0x40)  # an old V row overwritten
        else:
            kw["v_scale_cache"][:, :, 5] = 2.0
        return out

    monkeypatch.setitem(impls.IMPLS, "qkrope", impls.Impl("qkrope", "wrong", lambda: wrong))
    flags = ["--kv-dtype", "fp8", "--kv-scales", "per-token-head"]
    assert main(["bench", "--shape", "2,64,1", "--model", "qwen3-0.6b", *flags]) == 1
    name = "value_cache" if target == "codes" else "v_scale_cache"
    assert f"it changed {name} rows that no token of the call names" in \
        capsys.readouterr().out


def test_render_timed_report_with_nothing_run():
    # A GPU run whose every named implementation was skipped (e.g. --impl flashinfer).
    rep = fake_report()
    rep.impls = []
    for w in rep.workloads:
        w.impls = {}
    text = render_markdown(rep)
    assert "| 1 | 1 | 0 | 1 | 1 | 1.00 | 1.50 | — | — | — | — | — | — |" in text


@pytest.mark.gpu
@pytest.mark.parametrize("subset", ["eager", "torch.compile,eager", "flashinfer", "liger,qkrope"])
def test_cli_gpu_runs_impl_subsets(capsys, subset):
    # Every --impl subset works on a GPU too; without qkrope the first peer is the main column.
    rc = main(["bench", "--impl", subset, "--shape", "1,0,1", "--iters", "3", "--warmup", "1",
               "--host-calls", "20", "--no-graph", "--native-wait", "0"])
    out = capsys.readouterr().out
    assert rc == 0 and "Launch route:" in out
    main_impl = next((n for n in ("qkrope", "torch.compile", "eager") if n in subset), None)
    if main_impl:
        assert f"| {main_impl} µs |" in out
    if "flashinfer" in subset:
        assert "- skipped flashinfer: FlashInfer's fused op is token-major" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path of the CLI")
@pytest.mark.parametrize("layout", ["bhsd", "paged"])
def test_partial_rotary_presets_reach_every_impl_and_the_reference(monkeypatch, capsys, layout):
    """A geometry with op options (Qwen3.5: a quarter rotated, (1 + w) norms) is checked with
    them: an implementation that ignored them fails the rule."""
    from qkrope.bench import impls
    from qkrope.suite import MODELS

    assert MODELS["qwen3.5-27b"].options() == {"rotary_dim": 64, "norm_weight_offset": 1.0}
    assert main(["bench", "--layout", layout, "--shape", "3,1,2", "--model", "qwen3.5-27b"]) == 0
    assert "| pass |" in capsys.readouterr().out
    registry = impls.LAYOUTS[layout].impls
    real = registry["qkrope"].build()

    def ignores_options(*args, **options):  # the op at full rotary, plain weights
        return real(*args)

    monkeypatch.setitem(registry, "qkrope", impls.Impl("qkrope", "x", lambda: ignores_options))
    assert main(["bench", "--layout", layout, "--shape", "3,1,2", "--model", "qwen3.5-27b"]) == 1


def test_impls_without_options_are_skipped_for_such_presets():
    from qkrope.bench.impls import resolve_impls

    available, skipped = resolve_impls(["liger", "eager"], "bhsd", {"rotary_dim": 64})
    assert "liger" in skipped and "rotary_dim" in skipped["liger"] and "eager" in available


def test_paged_prefill_inputs_hold_every_batch_row():
    """The default paged cache of a B > 1 prefill has a slot for each of its B * S tokens."""
    from qkrope.suite import PAGED_BLOCK_SIZE, Workload, make_paged_inputs

    args = make_paged_inputs(Workload(5, 3, 4), device="cpu")
    slots, key_cache = args[6], args[4]
    assert int(slots.max()) < key_cache.shape[0] * PAGED_BLOCK_SIZE
    assert slots.tolist() == list(range(3, 3 + 20))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path of the CLI")
@pytest.mark.parametrize("flags, says", [
    (["--kv-dtype", "fp8", "--kv-scales", "per-token-head", "--q-out", "fp8"],
     "FP8 caches, per-token-head scales, FP8 query output"),
    (["--layout", "paged", "--kv-dtype", "fp8", "--model", "qwen3-0.6b"],
     "FP8 caches, per-tensor scales, bf16 query output"),
    (["--layout", "paged", "--kv-dtype", "int8", "--kv-scales", "per-token-head"],
     "INT8 caches, per-token-head scales, bf16 query output"),
    (["--kv-dtype", "fp8-e5m2", "--q-out", "fp8-e5m2"],
     "FP8-E5M2 caches, per-tensor scales, FP8-E5M2 query output, static scales 0.015625"),
    (["--kv-dtype", "fp8", "--q-out", "fp8", "--scale", "0.0166"],  # not a power of two
     "FP8 caches, per-tensor scales, FP8 query output, static scales 0.0166"),
])
def test_cli_quantised_modes_on_cpu(capsys, flags, says):
    rc = main(["bench", "--shape", "5,3,2", *flags])
    out = capsys.readouterr().out
    assert rc == 0 and says in out and out.count("| pass |") == 1


def test_quantised_mode_checks_have_teeth(monkeypatch, capsys):
    # An FP8 query output one code off in 2% of its elements fails after dequantisation.
    from qkrope.bench import impls
    from qkrope.ops.qknorm_rope.api import fused_rope_with_qk_norm_and_kv_cache_update as op

    def wrong(*args, **kw):
        out = op(*args, **kw)
        codes = out[0].view(torch.uint8).view(-1)
        codes[: codes.numel() // 50] ^= 0x08  # an exponent bit: twice or half the value
        return out

    monkeypatch.setitem(impls.IMPLS, "qkrope", impls.Impl("qkrope", "wrong", lambda: wrong))
    assert main(["bench", "--shape", "3,1,1", "--model", "qwen3-0.6b", "--q-out", "fp8"]) == 1
    assert "FAIL (98.0%)" in capsys.readouterr().out


def test_quantised_bytes_model():
    from qkrope.bench.quant import Quant
    from qkrope.suite import DEFAULT_MODEL

    w, g = SUITE[0], DEFAULT_MODEL
    assert Quant().bytes_moved(w, g) == bytes_moved(w, g)
    hq, hkv, d = g.num_q_heads, g.num_kv_heads, g.head_dim
    # FP8 query output and cache rows: one byte less per element; per-token-head: 4 B a row.
    assert Quant("fp8", "per-token-head", "fp8").bytes_moved(w, g) == (
        bytes_moved(w, g) - w.tokens * (hq * d + 2 * hkv * d - 2 * hkv * 4))


def test_cli_refuses_per_token_head_scales_without_fp8_caches(capsys):
    assert main(["bench", "--kv-scales", "per-token-head"]) == 2
    assert "--kv-scales per-token-head needs --kv-dtype fp8 or int8" in capsys.readouterr().err
    assert main(["bench", "--kv-dtype", "int8"]) == 2
    assert "--kv-dtype int8 needs --kv-scales per-token-head" in capsys.readouterr().err
    assert main(["bench", "--kv-dtype", "fp8-e5m2", "--kv-scales", "per-token-head"]) == 2
    assert "needs --kv-dtype fp8 (e4m3) or int8" in capsys.readouterr().err
    assert main(["bench", "--kv-dtype", "fp8", "--scale", "0"]) == 2
    assert "--scale must be finite and > 0, got 0.0" in capsys.readouterr().err
