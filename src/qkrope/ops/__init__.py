"""One folder per op: ``reference.py`` (the oracle), ``kernel.py`` (Triton), ``launcher.py``
(checks + launch), ``registration.py`` (the torch.library custom op used under torch.compile);
``_direct_launch.py`` is the eager fast path they share."""
