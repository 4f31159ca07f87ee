"""The programs of one compiled model, one per input signature, in a bounded cache.

A signature is the pytree structure of the call's arguments and every tensor's shape and dtype
(:func:`fxpar.ir.batch.signature`): a graph traced for one sequence length or batch size never runs on
another. Real loops change shapes (dynamic padding, a short last batch), so a new signature is
compiled on first use, with one log line naming its shapes, and kept in a least-recently-used cache of
``max_programs`` entries (``FXPAR_MAX_PROGRAMS``, default 8, as torch.compile's recompile limit). The
first signature (the training one, whose stages hold the parameters the optimizer, the data-parallel
engine and checkpoints read) is never dropped. Padding batches to a few lengths keeps the count low.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch.utils import _pytree as pytree

from fxpar.ir.batch import batch_size, signature
from fxpar.ir.options import run_options
from fxpar.runtime.memtrack import trim_heap

log = logging.getLogger("fxpar")


class ProgramCache:
    """``get(args, kwargs)`` -> (CompileResult, runtime, batch set-up) for these inputs.

    ``build(flat, spec, setup, program)`` compiles one signature; ``setup_for(batch)`` checks a batch
    size against the plan (a PlanError before any communication); ``runtime(result)`` makes the runtime
    that executes a result."""

    def __init__(self, build: Callable, setup_for: Callable, runtime: Callable, max_programs: int | None = None):
        self.build, self.setup_for, self.runtime = build, setup_for, runtime
        self.max_programs = int(max_programs) if max_programs is not None else run_options().max_programs
        self.entries: dict[tuple, tuple] = {}  # signature -> (result, runtime, setup), most recently used last
        self.first: tuple | None = None
        self.compiled = 0  # programs compiled so far (a dropped one compiled again counts again)
        self.last_key: tuple | None = None  # the signature of the last ``get``

    def get(self, args, kwargs, program=None) -> tuple:
        flat, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        key = self.last_key = signature(flat, spec)
        hit = self.entries.pop(key, None)
        if hit is None:
            setup = self.setup_for(batch_size(flat))
            shapes = ", ".join(str(tuple(v.shape)) for v in flat if isinstance(v, torch.Tensor))
            log.info("fxpar: compiling program %d for input shapes %s (batch %d = dp %d x %d microbatches of %d)",
                     self.compiled + 1, shapes, setup.batch, setup.dp, setup.microbatches, setup.microbatch_size)
            result = self.build(flat, spec, setup, program)
            hit = (result, self.runtime(result), setup)
            if self.compiled:  # a later signature, mid-run: what its compile freed goes back to the system
                trim_heap()
            self.compiled += 1
            self.first = self.first or key
        self.entries[key] = hit
        while len(self.entries) > max(self.max_programs, 1):
            del self.entries[next(k for k in self.entries if k != self.first)]
            log.info("fxpar: more than max_programs=%d input shapes: the least recently used program dropped",
                     self.max_programs)
        return hit
