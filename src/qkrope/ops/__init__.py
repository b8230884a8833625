"""One folder per op (``reference.py``, ``kernel.py``, ``launcher.py``, ``registration.py``,
``api.py``); ``_launch.py`` launches compiled kernels for every op (Triton's public launch and
the native fast path of ``_native.py`` / ``csrc/fast_path.cpp``)."""


def launch_route() -> str:
    """One line: which route launches repeated eager calls in this process, and why."""
    from ._launch import route

    name, why = route()
    return f"{name} ({why})"
