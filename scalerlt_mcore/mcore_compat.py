"""The Megatron-Core versions this project is tested on, and its MCore workarounds.

Every deviation from stock MCore is listed, per MCore version, in patches/README.md. The CPU
backend (`cpu_backend.py`) replaces MCore attributes; the workarounds registered here are project
code that compensates for an MCore behaviour without patching MCore. Each is keyed by the MCore
versions it was checked against and refuses any other through `require_mcore`, so an upgrade
stops at the first deviation it reaches with a message naming it and the tested versions,
instead of running on an assumption nobody re-checked.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import warnings

TESTED_MCORE = ("0.16.1", "0.19.2")
"""megatron-core releases the whole test suite ran on (`make test`, `make test-mcore`)."""

MCORE_VERSION = TESTED_MCORE[0]
"""The version `make test` installs (pyproject.toml allows >=0.16.1,<0.20)."""

# "module:qualname" of every @mcore_workaround, in import order: the ledger's W rows.
WORKAROUNDS: list[str] = []
WORKAROUND_VERSIONS: dict[str, tuple] = {}
"""The MCore versions each workaround was checked on (its ledger row's MCore column)."""


def found_mcore_version() -> str:
    """The installed megatron-core release, e.g. '0.19.2' ('unknown' when it does not say).

    The local part is dropped: MCore 0.19 appends ``+<git hash>`` to ``__version__`` when its
    package directory lies inside any git checkout (e.g. a virtual environment in a repository).
    """
    import megatron.core

    return getattr(megatron.core, "__version__", "unknown").split("+")[0]


def mcore_at_least(version: str) -> bool:
    """True when the installed megatron-core release is `version` or newer."""
    def key(v: str) -> tuple:
        return tuple(int(part) for part in v.split(".")[:3] if part.isdigit())

    return key(found_mcore_version()) >= key(version)


def require_mcore(what: str, versions: tuple = TESTED_MCORE) -> str:
    """The found MCore version; RuntimeError naming `what`, the versions it was written for and
    the found one unless it is one of `versions`."""
    found = found_mcore_version()
    if found not in versions:
        raise RuntimeError(
            f"{what} is written for megatron-core {' and '.join(versions)}; found megatron-core "
            f"{found}. Re-check it (patches/README.md) against that version before using it."
        )
    return found


DIST_CHECKPOINT_FILES = {
    "0.16.1": ("metadata.json", "common.pt", ".metadata"),
    "0.19.2": ("metadata.json", ".metadata"),
}
"""The files of an MCore ``torch_dist`` checkpoint directory besides its shards, per version:
0.19 keeps the common (non-tensor) state in the shards, as the sharded object ``common_state``,
instead of in ``common.pt``."""


def dist_checkpoint_files() -> tuple:
    """`DIST_CHECKPOINT_FILES` of the installed MCore (refusing an untested version)."""
    return DIST_CHECKPOINT_FILES[require_mcore("The MCore checkpoint layout check")]


def resolve(target: str):
    """Split 'pkg.module:Class.attr' into (owner object, attribute name)."""
    module_name, _, attr_path = target.partition(":")
    owner = importlib.import_module(module_name)
    *owners, name = attr_path.split(".")
    for part in owners:
        owner = getattr(owner, part)
    return owner, name


def _guarded(func, target: str, versions: tuple):
    """`func` that first checks the MCore version it was written for."""

    @functools.wraps(func)
    def guarded(*args, **kwargs):
        require_mcore(f"MCore workaround {target}", versions)
        return func(*args, **kwargs)

    return guarded


def mcore_workaround(obj=None, *, versions: tuple = TESTED_MCORE):
    """Register a function or class as an MCore workaround (a W row of patches/README.md) and
    guard it: each call (for a class, each construction) refuses an MCore version not in
    `versions`. Used bare (``@mcore_workaround``) or with the versions it was checked on."""
    if obj is None:
        return functools.partial(mcore_workaround, versions=versions)
    target = f"{obj.__module__}:{obj.__qualname__}"
    if target not in WORKAROUNDS:
        WORKAROUNDS.append(target)
    WORKAROUND_VERSIONS[target] = tuple(versions)
    if isinstance(obj, type):
        obj.__init__ = _guarded(obj.__init__, target, versions)
        return obj
    return _guarded(obj, target, versions)


def stock_schedule_kwargs(fn, kwargs: dict) -> dict:
    """`kwargs` bound to the keyword parameters of MCore's forward-backward function `fn`, its
    defaults filled in: the installed MCore's own signature (``inspect.signature``), so a step
    handed on to stock MCore gets every argument its caller passed, whatever that MCore version
    takes. TypeError naming an unknown or missing argument."""
    try:
        bound = inspect.signature(fn).bind(**kwargs)
    except TypeError as e:
        raise TypeError(f"{_qualname(fn)} of megatron-core {found_mcore_version()}: {e}") from None
    bound.apply_defaults()
    return dict(bound.arguments)


def _qualname(fn) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


FALLBACK_WARNING = r"(Transformer Engine and Apex are|Apex is) not installed"
"""MCore's import-time warnings that it falls back to local code (one per module that does)."""


def quiet_fallback_warnings() -> None:
    """Drop MCore's "Transformer Engine / Apex not installed" warnings (six per process here,
    one per MCore module that falls back); ``fallback_note`` says it once instead. Takes
    effect for MCore modules imported after the call."""
    warnings.filterwarnings("ignore", message=FALLBACK_WARNING)


def fallback_note() -> str:
    """One line naming what is missing of Transformer Engine and Apex, or '' when both are
    installed."""
    missing = [name for name, module in (("Transformer Engine", "transformer_engine"),
                                         ("Apex", "apex"))
               if importlib.util.find_spec(module) is None]
    if not missing:
        return ""
    return (f"{' and '.join(missing)} not installed: MCore uses its local fallbacks "
            "(PyTorch layers, norms and optimizers)")
