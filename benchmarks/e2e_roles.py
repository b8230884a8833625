"""Probe (leaves once answered; docs/perf-notes.md, lead 5 g): the end-to-end bench with other
models in its two roles. Is a worker process in which the op ran slower as a whole?

    python benchmarks/e2e_roles.py FIRST SECOND [qkrope bench --e2e ARGS]

FIRST / SECOND: what the bench's "stock" / "patched" workers hold, each one of ``stock``,
``patched`` and ``stock-op``: the stock model in a process where the patched model ran one
eager decode step first (the op's kernels built and loaded, its launch plans made), then
unpatched. ``stock stock-op`` reads in the patched column what having run the op costs a stock
step; ``stock stock`` is the A/A run it is read against. The spawned workers import this file
first and find the bench's ``_Variant`` replaced.
"""
import os
import sys

ROLES = ("stock", "patched", "stock-op")

if os.environ.get("QKROPE_E2E_ROLES"):
    import torch

    from qkrope.bench import e2e as _e2e
    from qkrope.integrations.transformers import unpatch

    _roles = dict(zip(("stock", "patched"), os.environ["QKROPE_E2E_ROLES"].split(",")))

    class _Roles(_e2e._Variant):
        def __init__(self, variant, *args):
            role = _roles[variant]
            super().__init__("patched" if role != "stock" else "stock", *args)
            if role == "stock-op":
                stream = torch.zeros(1, _e2e.PROMPT + 2, dtype=torch.long, device=self.device)
                ran = _e2e._Stepper(self.model, self.model.forward, stream, "decode",
                                    self.device, False)
                ran.step(0)  # the prompt's prefill and one decode step, through the op
                del ran
                unpatch(self.model)

    _e2e._Variant = _Roles

if __name__ == "__main__":
    first, second = sys.argv[1:3]
    if first not in ROLES or second not in ROLES:
        sys.exit(f"usage: e2e_roles.py FIRST SECOND [ARGS], each of {', '.join(ROLES)}")
    os.environ["QKROPE_E2E_ROLES"] = f"{first},{second}"
    from qkrope.cli import main

    sys.exit(main(["bench", "--e2e", *sys.argv[3:]]))
