"""HFTracer itself for :mod:`fxpar.frontend.hf_fx`: loading ``transformers.utils.fx``, and the
tracer subclass that records what the frontend needs.

:func:`load` imports ``transformers.utils.fx`` once and says why it is unusable where it is (HFTracer
exists only in transformers < 5). :func:`tracer_class` subclasses its ``HFTracer`` so that a trace
remembers the innermost module that failed and the type the root ``forward`` returned, and always
undoes HFTracer's patching of ``torch.arange`` & co., even when tracing fails.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

from fxpar.ir.errors import TraceError

FRONTEND = "hf_fx"


@functools.lru_cache(maxsize=1)
def load() -> tuple[Any, str]:
    """(transformers.utils.fx module or None, reason it is unavailable or "")."""
    try:
        import transformers
    except Exception as exc:  # not installed or broken
        return None, (f"transformers cannot be imported ({type(exc).__name__}: {exc}); install "
                      "transformers<4.48 or use frontend='export'")
    version = getattr(transformers, "__version__", "?")
    try:
        from transformers.utils import fx as hf_fx_module
        hf_fx_module.HFTracer  # noqa: B018 - the tracer itself is what we need
    except Exception as exc:
        if version_tuple(version) >= (5, 0):
            return None, (f"transformers {version} removed transformers.utils.fx (HFTracer exists only in "
                          "transformers < 5); install transformers<4.48 or use frontend='export'")
        return None, (f"transformers {version} has no usable transformers.utils.fx ({type(exc).__name__}: "
                      f"{exc}); install transformers<4.48 or use frontend='export'")
    return hf_fx_module, ""


def transformers_version() -> str:
    try:
        import transformers
        return transformers.__version__
    except Exception:
        return "?"


def version_tuple(v: str) -> tuple[int, int]:
    parts = []
    for p in v.split(".")[:2]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts + [0] * (2 - len(parts)))  # type: ignore[return-value]


@functools.lru_cache(maxsize=1)
def tracer_class():
    hf_fx_module, reason = load()
    if hf_fx_module is None:
        raise TraceError("the hf_fx frontend is not available", frontend=FRONTEND, hint=reason)

    class FxparHFTracer(hf_fx_module.HFTracer):
        """HFTracer that remembers what fxpar needs and cleans up after a failure.

        ``failed_module``: FQN of the innermost module whose forward raised (None: no module, i.e.
        the root). ``output_type``: the type the root ``forward`` returned (a ModelOutput class).
        """

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.failed_module: str | None = None
            self.output_type: type | None = None

        def call_module(self, m, forward, args, kwargs):
            try:
                return super().call_module(m, forward, args, kwargs)
            except Exception:
                if self.failed_module is None and not getattr(self, "_disable_call_module", False):
                    try:
                        self.failed_module = self.path_of_module(m)
                    except Exception:
                        stack = getattr(self, "module_stack", None)
                        self.failed_module = next(reversed(stack.values()))[0] if stack else ""
                raise

        def create_args_for_root(self, root_fn, is_module, concrete_args=None):
            fn, args = super().create_args_for_root(root_fn, is_module, concrete_args)

            @functools.wraps(fn)
            def recording(*a, **kw):
                out = fn(*a, **kw)
                self.output_type = type(out)
                return out

            return recording, args

        @contextlib.contextmanager
        def patch_for_tracing(self, root):
            # HFTracer's own context manager restores torch.arange & co. only when tracing succeeds;
            # after a failure they would stay patched for the whole process. Always restore them.
            cm = super().patch_for_tracing(root)
            cm.__enter__()
            try:
                yield
            finally:
                cm.__exit__(None, None, None)

    return FxparHFTracer
