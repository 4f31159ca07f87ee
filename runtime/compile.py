"""Each rank's stage graphs through ``torch.compile`` (Inductor), fxpar's collectives made visible to it.

Reads: a stage's GraphModule, the lowering of fxpar's collectives (``fxpar.passes.lower_collectives``,
handed in by the caller: the runtime does not import the passes) and this rank's process groups
(:mod:`fxpar.runtime.groups`). Writes: nothing of the stage; :func:`compile_stage` returns a callable the
pipeline runtime calls instead of the GraphModule.

* The stage is compiled whole (``fullgraph=True``) for the static shapes fxpar traced (``dynamic=False``);
  each input signature is its own program already, so nothing recompiles for shapes.
* Inductor's configuration for it is one profile (:func:`inductor_profile`), applied by
  ``torch._inductor.config.patch`` around the compilation (``compile_fx``'s ``config_patches``, which
  also covers the backward graph, compiled later): the lowering as ``post_grad_custom_pre_pass``, so it
  sees the forward and the backward graphs AOTAutograd made, after their ``torch.ops.fxpar.*`` nodes
  were traced through the ops' autograd formulas; comm/compute reordering on; one compile thread.
* The backward graph is compiled together with the forward (not lazily at the first backward), so a
  graph that cannot compile fails at its first call, before any of its collectives ran, and falls back
  to the eager GraphModule for good, with one warning naming the stage and the reason. Errors of a
  compiled graph at run time (a collective failing, a peer gone) are not compile failures and propagate.
* Pipeline sends and receives stay outside the compiled regions (the runtime does them between stage
  calls): a reordering pass that hoists a collective past a blocking send or receive on one rank only
  could deadlock.
"""

from __future__ import annotations

import hashlib
import inspect
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from fxpar.ir.errors import FxparError
from fxpar.runtime.groups import registered_groups, resolve_group

__all__ = ["CompiledStage", "compile_enabled", "compile_stage", "funcol_group", "inductor_profile"]

# Inductor's comm/compute overlap passes that run on every backend (the CPU included): start each
# collective as early as its inputs allow, sink each wait to its first use, and schedule compute that
# does not depend on a collective between the two.
OVERLAP_PASSES = ["reorder_compute_for_overlap", "sink_waits", "raise_comms"]


def compile_enabled(setting: bool | None, device: torch.device) -> bool:
    """What ``Plan.compile`` means on ``device``: None is on for CUDA and off elsewhere."""
    return setting if setting is not None else torch.device(device).type == "cuda"


def funcol_group(name: str) -> tuple[str, int, int] | None:
    """fxpar group ``name`` as torch's functional collectives take it: (process group name, size, this
    rank's index in it); None for a group of one rank (nothing to communicate)."""
    pg = resolve_group(name)
    if pg is None:
        return None
    return pg.group_name, pg.size(), dist.get_rank(pg)


def _lower_pass(lower: Callable):
    """The lowering as an Inductor ``CustomGraphPass`` (torch._inductor is imported only when compiling)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class _LowerCollectives(CustomGraphPass):
        """The lowering as Inductor's post-grad pre-pass. Its ``uuid`` (part of Inductor's graph cache key)
        covers the lowering's code and this process's group table: a cached graph names process groups, so
        a graph compiled where ``"tp:0,1"`` was another process group is never reused."""

        def __init__(self, lower: Callable):
            self.lower = lower

        def __call__(self, graph: torch.fx.Graph) -> None:
            self.lower(graph, funcol_group)

        def uuid(self) -> bytes:
            h = hashlib.sha256()
            try:
                h.update(Path(inspect.getfile(self.lower)).read_bytes())
            except (TypeError, OSError):
                h.update(repr(self.lower).encode())
            for name in sorted(registered_groups()):
                try:
                    h.update(f"{name}={funcol_group(name)};".encode())
                except FxparError:  # a group this rank is not in: no graph of this rank names it
                    continue
            return h.digest()

    return _LowerCollectives(lower)


def inductor_profile(lower: Callable | None) -> dict:
    """Inductor's configuration for a stage, each entry explained above (``lower``: None keeps fxpar's
    ops opaque, as they are in the IR)."""
    profile = {
        "reorder_for_compute_comm_overlap": True,
        "reorder_for_compute_comm_overlap_passes": list(OVERLAP_PASSES),
        "compile_threads": 1,  # the CPU boxes have 2 cores, shared with the ranks themselves
    }
    if lower is not None:
        profile["post_grad_custom_pre_pass"] = _lower_pass(lower)
    return profile


def _inductor(profile: dict) -> Callable:
    """A torch.compile backend: Inductor under ``profile``."""
    def backend(gm: torch.fx.GraphModule, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs, config_patches=profile)
    return backend


class CompiledStage:
    """Calls the compiled stage; on a failure to compile, warns once and calls the eager one from then on."""

    def __init__(self, gm: torch.fx.GraphModule, stage: int, backend: Callable):
        self.gm, self.stage = gm, stage
        self.compiled = torch.compile(gm, backend=backend, fullgraph=True, dynamic=False)
        self.failed: str | None = None  # why compiling failed, once it has

    def __call__(self, *args):
        if self.failed is not None:
            return self.gm(*args)
        try:
            with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
                return self.compiled(*args)
        except torch._dynamo.exc.TorchDynamoException as e:  # raised while compiling, before running
            self.failed = _reason(e)
            warnings.warn(f"fxpar: stage {self.stage} could not be compiled and runs eagerly ({self.failed})",
                          RuntimeWarning, stacklevel=2)
            return self.gm(*args)


def _reason(e: BaseException) -> str:
    """The root of a compile failure in one line (Inductor's errors wrap the backend's)."""
    inner = getattr(e, "inner_exception", None) or e.__cause__ or e
    lines = [ln.strip() for ln in str(inner).splitlines() if ln.strip()]
    return f"{type(inner).__name__}: {lines[0] if lines else ''}"[:300]


def compile_stage(gm: torch.fx.GraphModule, *, stage: int, lower: Callable | None) -> CompiledStage:
    """``gm`` (pipeline stage ``stage`` of this rank) compiled by Inductor under :func:`inductor_profile`
    on its first call; ``lower`` is ``fxpar.passes.lower_collectives.lower_collectives`` (None leaves
    fxpar's collectives opaque). Its backward is one autograd node: a zero-bubble schedule's ``I`` runs
    it whole and its ``W`` has nothing left to do."""
    return CompiledStage(gm, stage, _inductor(inductor_profile(lower)))
