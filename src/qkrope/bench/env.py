"""The environment a benchmark run records: versions, GPU, driver, launch route, source commit,
and the vendor bandwidth the "% spec BW" column divides by."""

from __future__ import annotations

import datetime
import os
import platform
import sys

import torch
import triton

from .. import __version__

__all__ = ["environment", "spec_bandwidth", "SPEC_BANDWIDTH", "collect_info", "INFO_LABELS"]

# Vendor datasheet HBM bandwidth (bytes/s) by GPU name, for the "% spec BW" column.
SPEC_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "B200": 8.0e12}

def spec_bandwidth(gpu_name: str | None) -> float | None:
    return next((bw for key, bw in SPEC_BANDWIDTH.items() if gpu_name and key in gpu_name), None)


def environment() -> dict:
    from ..ops import _native, launch_route

    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "qkrope": __version__, "torch": torch.__version__, "triton": triton.__version__,
        "python": platform.python_version(), "command": " ".join(["qkrope"] + sys.argv[1:]),
        "launch_route": launch_route(), "commit": _source_commit(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, sms=props.multi_processor_count,
                   l2_bytes=getattr(props, "L2_cache_size", None),
                   cuda=torch.version.cuda, driver=_driver_version(),
                   fast_path_helpers=_native.status())
    else:
        env.update(gpu=None, note="no CUDA device: correctness only, through Triton's interpreter")
    return env


def _source_commit() -> str | None:
    """The git commit of the qkrope source that runs (``-dirty`` with uncommitted changes to
    tracked files), or None outside a git checkout: results from a source tree that is not an
    installed release say which code they measured."""
    import subprocess

    src = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "-C", src, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", src, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def _driver_version() -> str | None:
    try:
        import subprocess

        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 else None
    except Exception:
        return None


def collect_info() -> dict:
    """What ``qkrope info`` prints: versions, GPUs, interpreter state, launch route."""
    import torch
    import triton

    from .._interpret import interpreting
    from ..ops import _native, launch_route

    info = {
        "qkrope": __version__,
        "python": f"{platform.python_version()} ({sys.executable})",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "torch_cuda": torch.version.cuda or "none (a CPU-only torch build)",
        "cuda_available": torch.cuda.is_available(),
    }
    gpus = []
    if torch.cuda.is_available():
        for k in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(k)
            gpus.append(f"{p.name} (capability {p.major}.{p.minor}, "
                        f"{p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB)")
        info["driver"] = _driver_version() or "unknown (nvidia-smi did not answer)"
    info["gpus"] = gpus
    env_value = os.environ.get("TRITON_INTERPRET")
    info["triton_interpreter"] = (
        f"on (TRITON_INTERPRET={env_value}"
        + ("; qkrope turns it on when no CUDA device is visible)" if not torch.cuda.is_available()
           else ")")
        if interpreting() else f"off (TRITON_INTERPRET={env_value or 'unset'})")
    info["launch_route"] = launch_route()
    try:
        info["native"] = _native.describe()
    except Exception as e:  # info must print even where the description fails
        info["native"] = {"status": _native.status(), "error": f"{type(e).__name__}: {e}"}
    return info


INFO_LABELS = {
    "qkrope": "qkrope version", "python": "Python version", "torch": "torch version",
    "triton": "Triton version", "torch_cuda": "CUDA used to build torch",
    "cuda_available": "CUDA available", "driver": "GPU driver", "gpus": "GPU",
    "triton_interpreter": "Triton interpreter", "launch_route": "launch route",
}
