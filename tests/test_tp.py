"""Tensor parallelism: ``benchmarks/tp_qwen3.py`` run as torchrun runs it (2 CPU processes on
gloo here, the kernels in Triton's interpreter; GPU variants for the lead's machine), its teeth
(a sabotaged patch must fail the run), and its single-process comparison rule on plain data."""

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import qkrope

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "tp_qwen3.py"
TIMEOUT_S = 600   # one CPU run takes ~20-30 s on two cores

_spec = importlib.util.spec_from_file_location("tp_qwen3", SCRIPT)
tp_qwen3 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tp_qwen3)


def torchrun(nproc, *args, script=SCRIPT):
    """Run ``script`` under torchrun; returns (exit code, stdout + stderr). The workers run the
    qkrope this test imported, and the whole process group is killed past the timeout."""
    src = str(Path(qkrope.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (src, os.environ.get("PYTHONPATH")) if p))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", str(script), *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its workers: our own session
        out, _ = proc.communicate()
        pytest.fail(f"torchrun timed out after {TIMEOUT_S} s:\n{out[-4000:]}")
    return proc.returncode, out


def assert_passed(rc, out, world, device):
    assert rc == 0, out[-6000:]
    assert f"{device} x{world} (" in out
    assert "| stock ms/step | qkrope ms/step |" in out
    assert "OK: patched TP == stock TP (tokens, every rank's cache)" in out, out[-3000:]
    assert "MISMATCH" not in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU (gloo, interpreter) runs; a GPU "
                    "machine runs test_one_gpu_process instead")
def test_two_cpu_ranks_on_gloo():
    rc, out = torchrun(2, "--device", "cpu", "--batch", "2")
    assert_passed(rc, out, 2, "cpu")
    assert "heads 4/2 (2/1 per rank)" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU (gloo, interpreter) runs; a GPU "
                    "machine runs test_one_gpu_process instead")
def test_a_patch_that_corrupts_the_cache_fails_the_run(tmp_path):
    # Adds 1 to every value-cache entry after each fused call: the script must see each rank's
    # cache differ from the stock one and exit non-zero on every rank.
    wrapper = tmp_path / "sabotaged.py"
    wrapper.write_text(f"""
import runpy, sys
from qkrope.integrations import transformers as integ

real = integ.fused_rope_with_qk_norm_and_kv_cache_update

def corrupting(*args, **kwargs):
    query, key, keys, values = real(*args, **kwargs)
    values.add_(1)
    return query, key, keys, values

integ.fused_rope_with_qk_norm_and_kv_cache_update = corrupting
sys.argv = [{str(SCRIPT)!r}, *sys.argv[1:]]
runpy.run_path({str(SCRIPT)!r}, run_name="__main__")
""")
    rc, out = torchrun(2, "--device", "cpu", script=wrapper)
    assert rc != 0
    assert "MISMATCH: a rank's StaticCache differs between patched and stock TP" in out
    assert "OK:" not in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU (gloo, interpreter) runs; a GPU "
                    "machine runs test_one_gpu_process instead")
def test_qk_norm_weights_kept_as_dtensors():
    # Older transformers' TP kept the replicated q_norm/k_norm weights as DTensors; the patch
    # must hand the kernel their local tensors (the op refuses a DTensor by name; the script
    # turns any fallback warning into an error).
    pytest.importorskip("transformers.distributed.parallel_utils",
                        reason="the script makes such weights with transformers' 'local_params' "
                               "style (newer transformers; not in 5.17)")
    rc, out = torchrun(2, "--device", "cpu", "--dtensor-norms")
    assert_passed(rc, out, 2, "cpu")
    assert "q/k norm weights as DTensors" in out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_one_gpu_process():
    # World size 1: transformers shards nothing; the script's GPU path (NCCL, the kernel,
    # timings) end to end.
    rc, out = torchrun(1, "--device", "cuda", "--new-tokens", "8")
    assert_passed(rc, out, 1, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_two_gpu_ranks_at_qwen3_32b_width():
    rc, out = torchrun(2, "--device", "cuda", "--config", "qwen3-32b-width", "--layers", "2",
                       "--new-tokens", "16")
    assert_passed(rc, out, 2, "cuda")
    assert "heads 64/8 (32/4 per rank), head_dim 128" in out


# --- the single-process comparison rule (check (b)) on synthetic logits ---------------------
def _case(vocab=8, prompt=3, new=4):
    torch.manual_seed(0)
    ref = torch.randn(1, prompt + new, vocab)
    tokens = ref[:, prompt - 1:-1].argmax(-1)  # greedy on the reference
    return prompt, tokens, ref


def test_judge_accepts_identical_tokens_and_close_logits():
    prompt, tokens, ref = _case()
    summary, failures = tp_qwen3.judge_single_process(prompt, tokens, tokens.clone(),
                                                      ref + 0.01, ref)
    assert failures == [] and "same tokens" in summary


def test_judge_rejects_logits_beyond_the_tolerance():
    prompt, tokens, ref = _case()
    summary, failures = tp_qwen3.judge_single_process(prompt, tokens, tokens.clone(),
                                                      ref + 0.5 * ref.abs().max(), ref)
    assert len(failures) == 1 and "of their RMS" in failures[0]


def test_judge_accepts_a_parting_at_a_near_tie_only():
    prompt, tokens, ref = _case()
    step = 2
    pos = prompt + step - 1               # the logits that picked new token `step`
    top2 = ref[0, pos].topk(2).indices
    margin = 0.02                         # the reference's runner-up, 2% of an RMS below
    ref[0, pos, top2[1]] = ref[0, pos, top2[0]] - margin
    tp_tokens = tokens.clone()
    tp_tokens[0, step] = top2[1]          # TP picked the runner-up
    tp_tokens[0, step + 1:] = 0           # and went its own way after it
    tp_logits = ref.clone()
    tp_logits[0, pos, top2[1]] += margin  # TP sees the two tied: max |diff| there = margin
    summary, failures = tp_qwen3.judge_single_process(prompt, tp_tokens, tokens, tp_logits, ref)
    assert failures == [] and "near-tie" in summary and f"new token {step}" in summary
    # A wide margin (the logits barely differ there) is a real difference.
    summary, failures = tp_qwen3.judge_single_process(prompt, tp_tokens, tokens, ref.clone(), ref)
    assert len(failures) == 1 and "not at a near-tie" in failures[0]
