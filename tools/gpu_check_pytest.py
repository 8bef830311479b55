"""pytest plugin of ``make gpu-check`` (``-p gpu_check_pytest``, with ``tools/`` on the path;
the normal suite never loads it): each test's peak GPU memory.

Around each test's call phase the CUDA allocator's peak is reset and read
(``torch.cuda.max_memory_allocated``, this process only: a test's subprocesses are not
counted). The peak goes into the test's ``user_properties`` (a ``peak_gpu_memory_bytes``
property in the JUnit XML) and a table at the end of the terminal report. Without CUDA (the
dry run) the property reads ``n/a``.
"""

import pytest

_peaks: dict = {}


def _cuda():
    import torch

    return torch.cuda if torch.cuda.is_available() else None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    cuda = _cuda()
    if cuda is not None:
        _quiet(cuda.synchronize)
        _quiet(cuda.reset_peak_memory_stats)
    yield
    peak = None
    if cuda is not None:  # after a CUDA error the test's own failure says it, not this hook
        _quiet(cuda.synchronize)
        peak = _quiet(cuda.max_memory_allocated)
    _peaks[item.nodeid] = peak
    item.user_properties.append(("peak_gpu_memory_bytes", "n/a" if peak is None else peak))


def _quiet(fn):
    try:
        return fn()
    except RuntimeError:
        return None


def pytest_terminal_summary(terminalreporter):
    tr = terminalreporter
    tr.write_sep("=", "peak GPU memory per test (torch.cuda.max_memory_allocated, this process)")
    for nodeid, peak in _peaks.items():
        tr.write_line(f"{'n/a' if peak is None else f'{peak / 2**20:10.1f} MiB'}  {nodeid}")
    if not _peaks:
        tr.write_line("(no test ran its call phase)")
