"""The MCore version layer: versions read without a local suffix, refusals naming the tested
versions, and the shared-prefix schedule taking exactly the installed MCore's forward-backward
keyword arguments (from its signature) and handing a plain step to stock MCore with all of them.
"""

import inspect

import megatron.core
import pytest
import torch
from megatron.core.pipeline_parallel import schedules

from scalerlt_mcore import mcore_compat
from scalerlt_mcore.mcore_compat import (
    TESTED_MCORE,
    found_mcore_version,
    mcore_workaround,
    require_mcore,
    stock_schedule_kwargs,
)
from scalerlt_mcore.shared_prefix import schedule as sp_schedule
from scalerlt_mcore.shared_prefix.schedule import get_shared_prefix_forward_backward_func


def test_installed_version_is_tested_and_local_suffix_dropped(monkeypatch):
    """MCore 0.19 appends '+<git hash>' inside a git checkout; the release is what counts."""
    assert found_mcore_version() in TESTED_MCORE
    monkeypatch.setattr(megatron.core, "__version__", "0.19.2+17de6e2")
    assert found_mcore_version() == "0.19.2"
    assert require_mcore("x") == "0.19.2"


@pytest.mark.parametrize("version", ["0.17.0", "0.19.1", "0.20.0"])
def test_untested_version_refused_naming_the_tested_ones(monkeypatch, version):
    monkeypatch.setattr(megatron.core, "__version__", version)
    with pytest.raises(RuntimeError, match=rf"thing is written for megatron-core 0\.16\.1 and "
                                           rf"0\.19\.2; found megatron-core {version}\."):
        require_mcore("thing")


def test_workaround_keyed_by_version(monkeypatch):
    """A workaround checked on one version only refuses the other tested one."""
    calls = []
    only_old = mcore_workaround(versions=("0.16.1",))(lambda: calls.append(1))
    try:
        monkeypatch.setattr(megatron.core, "__version__", "0.16.1")
        only_old()
        monkeypatch.setattr(megatron.core, "__version__", "0.19.2")
        with pytest.raises(RuntimeError, match=r"written for megatron-core 0\.16\.1; found "
                                               r"megatron-core 0\.19\.2"):
            only_old()
        assert calls == [1]
    finally:
        target = f"{__name__}:test_workaround_keyed_by_version.<locals>.<lambda>"
        mcore_compat.WORKAROUNDS.remove(target)
        del mcore_compat.WORKAROUND_VERSIONS[target]


def test_stock_schedule_kwargs_follow_the_signature():
    """Every parameter of the installed forward_backward_no_pipelining, defaults filled in;
    an unknown keyword is a TypeError naming it and the MCore version."""
    fn = schedules.forward_backward_no_pipelining
    params = inspect.signature(fn).parameters
    required = {n: n for n, p in params.items() if p.default is inspect.Parameter.empty}
    got = stock_schedule_kwargs(fn, required)
    assert list(got) == list(params)
    assert all(got[n] == p.default for n, p in params.items() if n not in required)
    with pytest.raises(TypeError, match=rf"forward_backward_no_pipelining of megatron-core "
                                        rf"{found_mcore_version()}: .*'no_such_flag'"):
        stock_schedule_kwargs(fn, {**required, "no_such_flag": 1})


def _fake_stock(signature: inspect.Signature, seen: list):
    """A forward-backward function with `signature` that records its keyword arguments."""

    def fake(**kwargs):
        seen.append(kwargs)
        return ["stock"]

    fake.__signature__ = signature
    return fake


def _plain_kwargs(signature: inspect.Signature) -> dict:
    """A distinct value for every parameter (the data iterator yields a plain tensor)."""
    return {name: (iter([torch.zeros(1)]) if name == "data_iterator" else f"<{name}>")
            for name in signature.parameters}


def test_plain_step_hands_every_stock_argument_to_mcore(mcore_single, monkeypatch):
    """Plain microbatches go to stock MCore with every argument of the installed
    forward_backward_no_pipelining, as passed; a keyword that a future MCore adds passes too,
    and one the installed function lacks is refused."""
    installed = inspect.signature(schedules.get_forward_backward_func())
    new_flag = inspect.Parameter("new_flag", inspect.Parameter.KEYWORD_ONLY, default=0)
    future = installed.replace(parameters=[*installed.parameters.values(), new_flag])
    for signature in (installed, future):
        seen = []
        monkeypatch.setattr(sp_schedule, "get_forward_backward_func",
                            lambda s=signature, seen=seen: _fake_stock(s, seen))
        kwargs = _plain_kwargs(signature)
        assert get_shared_prefix_forward_backward_func(2)(**kwargs) == ["stock"]
        (passed,) = seen
        assert torch.equal(next(passed.pop("data_iterator")), torch.zeros(1))
        assert passed == {k: v for k, v in kwargs.items() if k != "data_iterator"}
    assert {"pg_collection", "force_all_reduce", "p2p_communicator"} <= set(installed.parameters)
    monkeypatch.setattr(sp_schedule, "get_forward_backward_func",
                        lambda: _fake_stock(installed, []))
    with pytest.raises(TypeError, match="new_flag"):
        get_shared_prefix_forward_backward_func(2)(**_plain_kwargs(future))
