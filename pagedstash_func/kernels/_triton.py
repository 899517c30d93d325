"""Triton where it is installed, and a stand-in where it is not.

Triton ships wheels for Linux only, so on macOS and Windows the package installs without it
and every kernel op runs its pure-torch twin (`resolve_backend` picks the twin for
``"auto"`` and refuses ``"triton"``). The kernel files import ``triton``, ``tl`` and the
CUDA extras from here: with Triton they are Triton's own; without, ``@triton.jit`` keeps the
function as a kernel that raises when launched, and ``tl`` answers any name, so the kernel
files still define everything they define (their kernels are never compiled).
"""

from __future__ import annotations

__all__ = ["AVAILABLE", "MISSING", "gdc_launch_dependents", "gdc_wait", "tl", "triton"]

try:
    import triton
    import triton.language as tl
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    except ImportError as err:         # installed, but older than the kernels need
        raise ImportError(f"Triton {getattr(triton, '__version__', '?')} lacks what the "
                          f"kernels use ({err}): install triton>=3.6") from err
    AVAILABLE, MISSING = True, ""
except ImportError as err:             # macOS, Windows: no wheel of Triton exists
    AVAILABLE = False
    MISSING = (f"Triton is not installed ({err}); it has wheels for Linux only. The torch "
               f"twins of the kernels run instead (backend='torch', which 'auto' picks)"
               if "lacks what the kernels use" not in str(err) else
               f"{err}. Until then the torch twins of the kernels run (backend='torch')")

    class _Unlaunched:
        """A ``@triton.jit`` function without Triton: defined, never launched."""

        def __init__(self, fn):
            self.fn = fn
            self.__name__ = getattr(fn, "__name__", "kernel")
            self.__doc__ = getattr(fn, "__doc__", None)

        def __getitem__(self, grid):
            raise RuntimeError(f"{self.__name__} is a Triton kernel: {MISSING}")

        def __call__(self, *args, **kwargs):
            raise RuntimeError(f"{self.__name__} is a Triton kernel: {MISSING}")

    class _Triton:
        """What the kernel files read of ``triton`` outside a kernel body."""

        @staticmethod
        def jit(fn=None, **options):
            return _Unlaunched(fn) if fn is not None else _Unlaunched

        @staticmethod
        def cdiv(a, b):
            return -(-a // b)

    class _Language:
        """``tl``: any attribute, so that annotations (``BLOCK: tl.constexpr``) and
        module-level constants (``tl.constexpr(3)``) evaluate."""

        @staticmethod
        def constexpr(value=None):
            return value

        def __getattr__(self, name):
            return object

    def _unavailable(*args, **kwargs):
        raise RuntimeError(MISSING)

    triton, tl = _Triton(), _Language()
    gdc_wait = gdc_launch_dependents = _unavailable
