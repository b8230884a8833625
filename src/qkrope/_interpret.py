"""Whether Triton kernels run through Triton's CPU interpreter.

On a machine without CUDA the kernels can only run in the interpreter, so importing qkrope
there turns it on (``TRITON_INTERPRET=1``) unless the variable is already set. This must happen
before any ``@triton.jit`` function is defined, which is why ``qkrope/__init__.py`` imports this
module first.
"""

from __future__ import annotations

import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")
