"""One folder per op: ``reference.py`` (the oracle), ``kernel.py`` (Triton), ``launcher.py``
(checks + launch)."""
