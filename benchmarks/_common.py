"""What the benchmark scripts share: the CUDA guard, row names, inputs and forced tile
configs (kernel variants: ``variants.py``; experiments stay out of ``src/``).

Rows: ``1``-``13`` are SPEC §2 suite workloads ([B, H, S, D], ``qkrope.run``), ``p1``-``p3``
the paged workloads (token-major, NHD cache, ``qkrope.fused_qk_norm_rope_paged``), and
``S:C:B`` a custom [B, H, S, D] workload (S new tokens at cache offset C, B sequences).
"""

from __future__ import annotations

import contextlib
import sys
from typing import NamedTuple

import torch

from qkrope.ops.qknorm_rope import checks, launcher
from qkrope.ops._launch import KernelLauncher
from qkrope.suite import (DEFAULT_MODEL, PAGED_SUITE, SUITE, Workload, make_inputs,
                          make_paged_inputs)


def require_cuda(script: str) -> None:
    """Exit with one line (status 1) where the script's GPU part cannot run."""
    if not torch.cuda.is_available():
        sys.exit(f"{script}: needs CUDA (a GPU and a CUDA build of torch); this machine has "
                 f"none. See benchmarks/README.md for what runs without one.")


class Row(NamedTuple):
    label: str
    workload: Workload
    paged: bool


def parse_rows(text: str) -> list[Row]:
    """``"1,2,p1,128:0:4"`` -> rows (see the module docstring); raises ValueError naming the
    bad item."""
    rows = []
    for item in (s.strip() for s in text.split(",") if s.strip()):
        try:
            if item.startswith("p"):
                rows.append(Row(item, PAGED_SUITE[int(item[1:]) - 1], True))
            elif ":" in item:
                s, c, b = (int(x) for x in item.split(":"))
                if s < 1 or c < 0 or b < 1:
                    raise ValueError
                rows.append(Row(item, Workload(s, c, b), False))
            else:
                n = int(item)
                if n < 1:
                    raise IndexError
                rows.append(Row(item, SUITE[n - 1], False))
        except (ValueError, IndexError):
            raise ValueError(f"row {item!r}: want a suite number 1-{len(SUITE)}, p1-"
                             f"p{len(PAGED_SUITE)} or S:C:B") from None
    return rows


def row_inputs(row: Row, device="cuda", generator=None, cache_capacity=None,
               geometry=DEFAULT_MODEL) -> tuple:
    """The eleven public-API arguments of ``row`` (SPEC §2 construction) for ``geometry``."""
    make = make_paged_inputs if row.paged else make_inputs
    return make(row.workload, geometry, device=device, generator=generator,
                cache_capacity=cache_capacity)


def row_op(row: Row):
    import qkrope

    return qkrope.fused_qk_norm_rope_paged if row.paged else qkrope.run


def row_options(row: Row, **fields) -> checks.Options:
    """The options a default public call of ``row`` launches with (``fields`` override)."""
    return checks.Options(layout="NHD" if row.paged else "bhsd")._replace(**fields)


def launch_args(args: tuple, query_out, key_out, opts: checks.Options,
                k_scale=None, v_scale=None, q_scale=None, k_scale_cache=None,
                v_scale_cache=None) -> tuple:
    """``launcher.launch``'s positional arguments for public-API ``args`` (either layout)."""
    return (*args[:10], k_scale, v_scale, q_scale, k_scale_cache, v_scale_cache, query_out,
            key_out, args[10], opts)


# --------------------------------------------------------------------------------------------
# forced tiles (kernel variants: variants.py)
# --------------------------------------------------------------------------------------------
def parse_config(text: str) -> launcher.TileConfig:
    """``"BLOCK_HQ,BLOCK_HKV,BLOCK_T,num_warps"`` -> TileConfig."""
    try:
        values = [int(x) for x in text.split(",")]
        if len(values) != 4 or min(values) < 1 or any(v & (v - 1) for v in values):
            raise ValueError
    except ValueError:
        raise ValueError(f"config {text!r}: want four powers of two "
                         "BLOCK_HQ,BLOCK_HKV,BLOCK_T,num_warps") from None
    return launcher.TileConfig(*values)


_launchers: dict = {}


@contextlib.contextmanager
def forced(kernel=None, config: launcher.TileConfig | None = None, num_sms: int | None = None,
           capture: list | None = None):
    """Inside: ``launcher.launch`` runs ``kernel`` (Triton's public launch) with tile
    ``config`` instead of ``pick_config``'s, ``pick_config`` sees ``num_sms`` SMs, and with
    ``capture`` nothing is launched: each launch appends ``(grid, args, meta)`` to it
    (``launcher.launch`` checks nothing: meta tensors, which all sit at address 0, are fine).

    Swaps module globals of ``launcher`` for the duration (scripts only; not thread-safe)."""
    saved = {n: getattr(launcher, n) for n in ("LAUNCHER", "pick_config", "_num_sms")}
    pick = launcher.pick_config.__wrapped__  # uncached: the SM count may differ per call
    if kernel is not None:
        if kernel not in _launchers:
            _launchers[kernel] = KernelLauncher(kernel, launcher.PER_CALL)
        launcher.LAUNCHER = _launchers[kernel]
    if capture is not None:
        class Capture:
            def launch(self, grid, args, meta, device):
                capture.append((grid, args, meta))

        launcher.LAUNCHER = Capture()
    if num_sms is not None:
        launcher._num_sms = lambda: num_sms
    if config is not None:
        launcher.pick_config = lambda *a: config
    elif num_sms is not None:
        launcher.pick_config = pick
    try:
        yield
    finally:
        for n, v in saved.items():
            setattr(launcher, n, v)
