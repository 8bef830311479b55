"""The Megatron-Core version this project is written for, and its MCore workarounds.

Every deviation from stock MCore is listed in patches/README.md. The CPU backend
(`cpu_backend.py`) replaces MCore attributes; the workarounds registered here are project code
that compensates for an MCore 0.16.1 behaviour without patching MCore. Both refuse another
MCore version through `require_mcore`, so an upgrade stops at the first workaround it reaches
with a message naming it, instead of running on an assumption nobody re-checked.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import warnings

MCORE_VERSION = "0.16.1"

# "module:qualname" of every @mcore_workaround, in import order: the ledger's W rows.
WORKAROUNDS: list[str] = []


def found_mcore_version() -> str:
    """The installed megatron-core version ('unknown' when it does not say)."""
    import megatron.core

    return getattr(megatron.core, "__version__", "unknown")


def require_mcore(what: str) -> None:
    """Raise RuntimeError naming `what` and the found version unless MCore is 0.16.1."""
    found = found_mcore_version()
    if found != MCORE_VERSION:
        raise RuntimeError(
            f"{what} is written for megatron-core {MCORE_VERSION}; found megatron-core "
            f"{found}. Re-check it (patches/README.md) against that version before using it."
        )


def resolve(target: str):
    """Split 'pkg.module:Class.attr' into (owner object, attribute name)."""
    module_name, _, attr_path = target.partition(":")
    owner = importlib.import_module(module_name)
    *owners, name = attr_path.split(".")
    for part in owners:
        owner = getattr(owner, part)
    return owner, name


def _guarded(func, target: str):
    """`func` that first checks the MCore version it was written for."""

    @functools.wraps(func)
    def guarded(*args, **kwargs):
        require_mcore(f"MCore workaround {target}")
        return func(*args, **kwargs)

    return guarded


def mcore_workaround(obj):
    """Register a function or class as an MCore workaround (a W row of patches/README.md) and
    guard it: each call (for a class, each construction) refuses another MCore version."""
    target = f"{obj.__module__}:{obj.__qualname__}"
    if target not in WORKAROUNDS:
        WORKAROUNDS.append(target)
    if isinstance(obj, type):
        obj.__init__ = _guarded(obj.__init__, target)
        return obj
    return _guarded(obj, target)


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
