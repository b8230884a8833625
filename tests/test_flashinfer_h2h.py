"""CPU checks of benchmarks/flashinfer_h2h.py (the FlashInfer head-to-head): its inputs follow
FlashInfer's position/slot rules, and its comparisons catch a wrong op. FlashInfer's kernel is
SM90+ only, so it is replaced here by an independent torch model of its documented semantics."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

import qkrope
from qkrope.ops.qknorm_rope.reference import cos_sin_ref, rope_angles_ref

# The harness against a torch model of FlashInfer's op, on the CPU (its inputs are built on the
# CPU and it must find no GPU); on a GPU machine the harness itself runs against FlashInfer.
pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="CPU tests of the harness; on a GPU run "
                                       "benchmarks/flashinfer_h2h.py")

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "flashinfer_h2h.py"
_spec = importlib.util.spec_from_file_location("flashinfer_h2h", _PATH)
h2h = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = h2h  # dataclasses look their module up there
_spec.loader.exec_module(h2h)

# FlashInfer's second supported head configuration (8, 1) keeps the interpreter quick.
HQ, HKV = 8, 1


def fake_flashinfer(qkv, cos_sin, seq_lens, q_indptr, page_indices, key_cache, value_cache, *,
                    num_q_heads, num_kv_heads, qk_norm_policy=0, q_norm_weight=None,
                    k_norm_weight=None, eps=1e-6, out_q=None, out_k=None, out_v=None,
                    clear_unused_last_page_rows=True, enable_pdl=False, position_shift=0):
    """FlashInfer's op as its docstring specifies it (argument checks of its backend included),
    written from q_indptr/seq_lens/page_indices, not from the harness's slots.
    ``position_shift`` plants a bug (rows rotated and written one position off)."""
    D = 128
    assert qkv.dtype == torch.bfloat16 and qkv.dim() == 2
    assert qkv.shape[1] == (num_q_heads + 2 * num_kv_heads) * D
    assert cos_sin.dtype == torch.float32 and cos_sin.shape[1] == D
    for t in (seq_lens, q_indptr, page_indices):
        assert t.dtype == torch.int32
    assert q_indptr.shape[0] == seq_lens.shape[0] + 1 and page_indices.dim() == 2
    for w in (q_norm_weight, k_norm_weight):
        assert w.dtype == torch.float32 and tuple(w.shape) == (D,)
    for t in (qkv, cos_sin, seq_lens, q_indptr, page_indices, key_cache, value_cache,
              q_norm_weight, k_norm_weight):
        assert t.is_contiguous()
    assert qk_norm_policy == 2 and out_k is None and out_v is None
    T, ps = qkv.shape[0], key_cache.shape[1]
    rows = torch.arange(T)
    req = torch.searchsorted(q_indptr[1:].long(), rows, right=True)
    pos = rows + seq_lens.long()[req] - q_indptr.long()[req + 1] + position_shift
    q, k, v = qkv.view(T, num_q_heads + 2 * num_kv_heads, D).split(
        [num_q_heads, num_kv_heads, num_kv_heads], dim=1)
    cos, sin = cos_sin[pos, :64][:, None], cos_sin[pos, 64:][:, None]

    def norm_rope(x, w):
        xf = x.float()
        n = xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w
        a, b = n[..., :64], n[..., 64:]
        return torch.cat((a * cos - b * sin, b * cos + a * sin), -1).to(torch.bfloat16)

    page = page_indices.long()[req, pos // ps]
    key_cache[page, pos % ps] = norm_rope(k, k_norm_weight)
    value_cache[page, pos % ps] = v
    if clear_unused_last_page_rows:
        for b in range(seq_lens.shape[0]):
            last = (int(seq_lens[b]) - 1) // ps
            first_unused = (int(seq_lens[b]) - 1) % ps + 1
            key_cache[page_indices[b, last], first_unused:] = 0
            value_cache[page_indices[b, last], first_unused:] = 0
    q_rot = norm_rope(q, q_norm_weight)
    if out_q is None:
        return q_rot
    out_q.copy_(q_rot)
    return out_q


def _inputs(spec: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return h2h.build_case(h2h.Case.parse(spec), "cpu", g, hq=HQ, hkv=HKV)


def test_case_parse():
    assert h2h.Case.parse("d64") == h2h.Case("d64", 64, 1)
    assert h2h.Case.parse("p2048").tokens == 2048
    for bad in ("x3", "d", "p0", "d-1"):
        with pytest.raises(ValueError, match="case"):
            h2h.Case.parse(bad)


@pytest.mark.parametrize("spec", ["d5", "p37"])
def test_inputs_follow_flashinfer_rules(spec):
    inp = _inputs(spec)
    T, ps = inp["qkv"].shape[0], inp["key_cache"].shape[1]
    seq_lens, q_indptr = inp["seq_lens"].long(), inp["q_indptr"].long()
    req = torch.searchsorted(q_indptr[1:], torch.arange(T), right=True)
    expect_pos = torch.arange(T) + seq_lens[req] - q_indptr[req + 1]
    assert torch.equal(inp["positions"], expect_pos)
    assert (inp["positions"] >= 0).all()
    page = inp["page_indices"].long()[req, expect_pos // ps]
    assert torch.equal(inp["slots"], page * ps + expect_pos % ps)
    assert inp["slots"].unique().numel() == T  # no two tokens share a cache row
    assert int(inp["slots"].max()) < inp["key_cache"].shape[0] * ps
    if spec.startswith("p"):  # prefill crosses pages: they must be scattered, not contiguous
        assert torch.equal(inp["positions"], torch.arange(T))
        assert not torch.equal(inp["slots"], torch.arange(T))
    # The f32 table holds exactly the bf16 cos/sin the reference uses.
    cos, sin = cos_sin_ref(rope_angles_ref(inp["positions"], inp["inv_freq"]), torch.bfloat16)
    assert torch.equal(inp["cos_sin"][inp["positions"]], torch.cat((cos, sin), -1).float())
    assert inp["q_w"].dtype == torch.bfloat16 and not torch.equal(inp["q_w"], torch.ones(128))


def test_reference_is_qkropes_oracle_on_the_split_projection():
    inp = _inputs("d3")
    q, k, v = h2h.split(inp)
    ref = h2h.reference(inp)
    again = qkrope.reference_paged(q.clone(), k.clone(), v.clone(), inp["positions"],
                                   inp["key_cache"], inp["value_cache"], inp["slots"], inp["q_w"],
                                   inp["k_w"], inp["inv_freq"], inp["eps"])
    for a, b in zip(ref, again):
        assert torch.equal(a, b)


def test_diff_counts_bits():
    a = torch.randn(4, 8, dtype=torch.bfloat16)
    assert h2h.diff(a, a.clone()) == {"max_abs": 0.0, "identical_pct": 100.0, "finite": True}
    b = a.clone()
    b[0, 0] += 1
    d = h2h.diff(b, a)
    assert d["identical_pct"] == pytest.approx(100 * 31 / 32)
    assert d["max_abs"] == pytest.approx(abs(float(b[0, 0]) - float(a[0, 0])))
    with pytest.raises(ValueError, match="shape"):
        h2h.diff(a, a[:2])


@pytest.mark.parametrize("spec", ["d3", "p20"])
def test_check_case_with_flashinfer_model(spec):
    inp = _inputs(spec)
    res = h2h.check_case(inp, fake_flashinfer)
    q, fi = res["qkrope"], res["flashinfer"]
    for r in (q, fi):
        assert r["k_cache"]["others_untouched"] and r["v_cache"]["others_untouched"]
        assert r["v_cache"]["identical_pct"] == 100.0  # V is a copy
        assert r["q"]["finite"] and r["q"]["max_abs"] < 0.1
    assert q["q"]["identical_pct"] > 99.0
    # The model writes from the page table, the emulation from the harness's slots: identical
    # results mean the two routes to a cache row agree.
    for key in ("q_vs_emulation", "k_cache_vs_emulation", "v_cache_vs_emulation"):
        assert fi[key]["identical_pct"] == 100.0, key
    # One rounding in f32 is closer to the exact result than the reference's bf16 steps.
    assert fi["q_exact_max_abs"] <= res["reference"]["q_exact_max_abs"]
    assert res["flashinfer_f32_table"]["q_exact_max_abs"] <= fi["q_exact_max_abs"] + 1e-2
    report = h2h.markdown([{"case": spec, "tokens": inp["qkv"].shape[0], "check": res}],
                          {"flashinfer_version": "fake", "route": "test",
                           "libraries": {"lib": "stage"}})
    assert f"| {spec} |" in report and "FlashInfer fake via test libraries" in report


def test_check_case_catches_a_misplaced_row():
    inp = _inputs("d3")
    assert (inp["positions"] >= 1).all()

    def shifted(*args, **kwargs):
        return fake_flashinfer(*args, position_shift=-1, **kwargs)

    fi = h2h.check_case(inp, shifted)["flashinfer"]
    assert not fi["v_cache"]["others_untouched"]
    assert fi["v_cache"]["identical_pct"] < 100.0


def test_clear_column_model_zeroes_the_rest_of_the_last_page():
    inp = _inputs("d2")
    kc, vc = h2h.fresh_caches(inp)
    h2h.flashinfer_call(fake_flashinfer, inp, kc, vc, clear=True)
    ps = kc.shape[1]
    for b in range(2):
        slot = int(inp["slots"][b])
        page, off = divmod(slot, ps)
        assert (kc[page, off + 1:] == 0).all() and (vc[page, off + 1:] == 0).all()
        assert torch.equal(vc[page, off], h2h.split(inp)[2][b])


def test_unavailable_flashinfer_reports_evidence(monkeypatch):
    def broken():
        raise ImportError("No module named 'tvm_ffi'")

    monkeypatch.setattr(h2h, "import_flashinfer", broken)
    with pytest.raises(h2h.FlashInferUnavailable, match="import failed") as info:
        h2h.load_flashinfer([h2h.Case.parse("d1")], force_jit=False)
    ev = info.value.evidence
    assert "No module named 'tvm_ffi'" in ev["traceback"]
    for key in ("fi_site_exists", "nvcc_version", "torch", "aot"):
        assert key in ev


def test_main_needs_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    assert h2h.main(["--cases", "d1"]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_run_cases_checks_times_and_saves(tmp_path):
    seen = []

    def timing(inp):
        seen.append(("timing", inp["qkv"].shape[0]))
        return {"qkrope": {"median_us": 2.0}, "flashinfer": {"median_us": 3.0}}

    def host(inp):
        seen.append(("host", inp["qkv"].shape[0]))
        return {"qkrope_us": 10.0, "flashinfer_us": 12.0, "ratio": 1.2}

    cases = [h2h.Case.parse("d2"), h2h.Case.parse("p18")]
    orig = h2h.build_case
    h2h.build_case = lambda case, device, g: orig(case, device, g, hq=HQ, hkv=HKV)
    try:
        rows = h2h.run_cases(cases, fake_flashinfer, device="cpu", seed=0, timing=timing,
                             host=host, deadline=float("inf"))
    finally:
        h2h.build_case = orig
    assert seen == [("timing", 2), ("host", 2), ("timing", 18)]  # host time: decode only
    assert [r["case"] for r in rows] == ["d2", "p18"]
    assert rows[1]["check"]["flashinfer"]["k_cache"]["others_untouched"]
    path = tmp_path / "out" / "h2h.json"
    h2h.write_json(str(path), h2h.result_payload(rows, {"gpu": "cpu"}, {"route": "test"}, {}))
    saved = json.loads(path.read_text())
    assert saved["status"] == "ok" and saved["cases"][1]["num_seqs"] == 1
    assert saved["cases"][1]["tokens_per_seq"] == 18
    table = h2h.markdown(rows, None)
    assert "| d2 | 2 | 2.00 | 3.00 | 1.50 | — |" in table


def test_run_cases_stops_at_the_deadline(capsys):
    rows = h2h.run_cases([h2h.Case.parse("d1")], fake_flashinfer, device="cpu", seed=0,
                         timing=None, host=None, deadline=0.0)
    assert rows == [] and "deadline reached" in capsys.readouterr().out


def test_old_typing_extensions_is_swapped_for_the_carried_one(monkeypatch, tmp_path):
    compat = tmp_path / "compat"
    compat.mkdir()
    (compat / "typing_extensions.py").write_text("def get_annotations(obj):\n    return {}\n")
    old = type(sys)("typing_extensions")  # a module without get_annotations (< 4.13)
    monkeypatch.setitem(sys.modules, "typing_extensions", old)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(h2h, "FI_SITE", tmp_path / "absent")
    monkeypatch.setattr(h2h, "FI_COMPAT", compat)
    with pytest.raises(ImportError):  # no FlashInfer here: the swap happens before that
        h2h.import_flashinfer()
    assert sys.modules["typing_extensions"].__file__ == str(compat / "typing_extensions.py")
