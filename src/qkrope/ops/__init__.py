"""One folder per op (``api.py``, ``checks.py``, ``registration.py``, ``launcher.py``,
``kernel.py``, ``reference.py``); ``_custom_op.py`` registers any op for torch.compile;
``_launch.py`` launches compiled kernels for every op (Triton's public launch and the native
fast path of ``_native.py`` / ``csrc/``)."""


def launch_route() -> str:
    """One line: which route launches repeated eager calls in this process, and why."""
    from ._launch import route

    name, why = route()
    return f"{name} ({why})"
