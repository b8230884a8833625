"""Probe (leaves once answered): the end-to-end bench with its variants' roles changed.

Does the bench's protocol (workers per variant, stock's block timed before patched's in every
pair) give the second-timed variant a longer host part or step on its own?

    python benchmarks/e2e_aa.py aa|ba [qkrope bench --e2e ARGS]

``aa``: both variants stock (an A/A run). ``ba``: the roles swapped, so the patched model is
timed first in every pair and reads as "stock" in the table. The spawned workers import this
file first and find the bench's ``_Variant`` replaced.
"""
import os
import sys

_ROLES = {"aa": {"stock": "stock", "patched": "stock"},
          "ba": {"stock": "patched", "patched": "stock"}}

if os.environ.get("QKROPE_E2E_PROBE") in _ROLES:
    from qkrope.bench import e2e as _e2e

    _roles = _ROLES[os.environ["QKROPE_E2E_PROBE"]]

    class _Swapped(_e2e._Variant):
        def __init__(self, variant, *args):
            super().__init__(_roles[variant], *args)

    _e2e._Variant = _Swapped

if __name__ == "__main__":
    os.environ["QKROPE_E2E_PROBE"] = sys.argv[1]
    from qkrope.cli import main

    sys.exit(main(["bench", "--e2e", *sys.argv[2:]]))
