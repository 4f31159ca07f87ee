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
* Mixed precision: Inductor rounds each low-precision intermediate of a fused kernel as eager autocast
  does (``emulate_precision_casts``). Without it a fused kernel keeps bf16 intermediates in fp32: a
  1-layer tiny llama's bf16 losses were 4e-5 from eager's at the first step and 1.1e-3 at the third
  (SGD, lr 0.1); with it 5e-7, as in fp32.
* ZeRO-3 regathers in backward: :func:`mark_regather`, Inductor's ``joint_custom_pre_pass``, marks each
  ``gather_params`` and the views of its bucket must-recompute in the joint graph (SimpleFSDP's way), so
  the partitioner saves the shard, not the gathered bucket, and backward gathers it again. The eager
  path does the same with saved-tensor hooks (``fxpar.runtime.zero3.Zero3Regather``), which a compiled
  graph bypasses.
* Bucketing: Inductor merges ZeRO-3's gathers (all-gathers of a graph input) and gradient
  reduce-scatters (whose result only flows to outputs) into launches of up to
  :data:`ZERO3_BUCKET_CAP_MB` per group and dtype ("only_fsdp": TP's collectives of activations inside a
  stage are left alone; a sequence-parallel gather of a stage's input qualifies too). The merged gather
  packs its inputs with one generated copy-in kernel.
* Async TP (CUDA only, untested: no GPU here): a stage with sequence-parallel collectives gets
  Inductor's micro-pipeline TP pass and symmetric memory for its TP groups (:func:`enable_async_tp`).
  On CPU it is off: the pass needs NCCL and its fused ops have no CPU kernels.
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
import operator
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.fx._lazy_graph_module import _LazyGraphModule

from fxpar.ir.errors import FxparError
from fxpar.ir.ops import collective_kind
from fxpar.ir.options import run_options
from fxpar.ir.plan import Plan
from fxpar.ir.resolved import DEFAULT_BUCKET_MB
from fxpar.runtime.groups import registered_groups, resolve_group

__all__ = ["CompiledStage", "compile_enabled", "compile_stage", "enable_async_tp", "funcol_group", "inductor_profile",
           "mark_regather", "zero3_bucket_cap_mb"]

# Inductor's comm/compute overlap passes that run on every backend (the CPU included): start each
# collective as early as its inputs allow, sink each wait to its first use, and schedule compute that
# does not depend on a collective between the two.
OVERLAP_PASSES = ["reorder_compute_for_overlap", "sink_waits", "raise_comms"]
ZERO3_BUCKET_CAP_MB = float(DEFAULT_BUCKET_MB)  # what Inductor may merge ZeRO-3's gathers into


def compile_enabled(setting: bool | None, device: torch.device) -> bool:
    """What ``Plan.compile`` means on ``device`` (:meth:`fxpar.ir.plan.Plan.compiles_on`)."""
    return Plan(compile=setting).compiles_on(device)


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


def mark_regather(graph: torch.fx.Graph) -> int:
    """ZeRO-3 in a compiled graph: mark every ``gather_params`` of the joint forward-backward graph, and
    the views of its bucket (the parameters' slices, reshapes, transposes), as must-recompute, so
    AOTAutograd's min-cut partitioner gathers the bucket again in backward instead of saving it (or a
    view of it) from forward to backward. This is what :class:`fxpar.runtime.zero3.Zero3Regather` does
    for the eager graph through saved-tensor hooks, which see nothing inside a compiled graph. The views
    are marked too because a saved view keeps the whole gathered bucket alive.

    ``ac_graph_id`` is torch's checkpoint region id: the partitioner saves a recomputed node whose user
    is recomputed in a region of a higher id. A node already in a region (``Plan.recompute`` moved the
    gather into its layer) keeps its region's; the others get ids above every region's, so a layer
    reading the bucket does not turn the gather into a saved value. Returns how many gathers were marked."""
    from torch.utils.checkpoint import CheckpointPolicy

    regions = [n.meta["ac_graph_id"] for n in graph.nodes if isinstance(n.meta.get("ac_graph_id"), int)]
    next_id = max(regions, default=0) + 1
    marked = 0
    for node in graph.nodes:
        if collective_kind(node) != "gather_params":
            continue
        marked += 1
        todo, region = [node], node.meta.get("ac_graph_id", next_id)
        next_id += 1
        while todo:
            n = todo.pop()
            n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            n.meta.setdefault("ac_graph_id", region)
            todo.extend(u for u in n.users if getattr(u.target, "is_view", False) or u.target is operator.getitem)
    return marked


def _regather_pass():
    """:func:`mark_regather` as Inductor's ``joint_custom_pre_pass`` (it runs on the joint graph, before
    the partitioner); its ``uuid`` is the function's source."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class _Regather(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            mark_regather(graph)

        def uuid(self) -> bytes:
            return hashlib.sha256(inspect.getsource(mark_regather).encode()).digest()

    return _Regather()


def zero3_bucket_cap_mb(bucket_index: int) -> float:
    """Inductor's cap on a merged all-gather / reduce-scatter bucket (in MiB, whatever its index): fxpar's
    own default ZeRO-3 bucket size. Inductor's default (2 GB) merges every gather of a graph into one,
    so the whole model's parameters would be live at once: the memory ZeRO-3 exists to save."""
    return ZERO3_BUCKET_CAP_MB


def inductor_profile(lower: Callable | None, *, async_tp: bool = False) -> dict:
    """Inductor's configuration for a stage, each entry explained above (``lower``: None keeps fxpar's
    ops opaque, as they are in the IR; ``async_tp``: micro-pipeline TP, CUDA only)."""
    profile = {
        "reorder_for_compute_comm_overlap": True,
        "reorder_for_compute_comm_overlap_passes": list(OVERLAP_PASSES),
        "compile_threads": 1,  # the CPU boxes have 2 cores, shared with the ranks themselves
        "emulate_precision_casts": True,  # bf16 intermediates rounded as in eager autocast
        "joint_custom_pre_pass": _regather_pass(),
        # "only_fsdp": gathers of one graph input (a ZeRO-3 shard, cast or not) and reduce-scatters whose
        # result only flows to graph outputs (its gradient); TP's gathers of activations are left alone
        "bucket_all_gathers_fx": "only_fsdp",
        "bucket_reduce_scatters_fx": "only_fsdp",
        "bucket_all_gathers_fx_bucket_size_determinator": zero3_bucket_cap_mb,
        "bucket_reduce_scatters_fx_bucket_size_determinator": zero3_bucket_cap_mb,
    }
    if async_tp:
        profile["_micro_pipeline_tp"] = True
    if lower is not None:
        profile["post_grad_custom_pre_pass"] = _lower_pass(lower)
    return profile


def enable_async_tp(gm: torch.fx.GraphModule, device: torch.device | None) -> bool:
    """On CUDA, for a stage with sequence-parallel collectives (``all_gather_rs_bwd``, ``reduce_scatter``):
    symmetric memory for their groups, which Inductor's micro-pipeline TP pass requires before it fuses
    all-gather -> matmul and matmul -> reduce-scatter. Untested: no GPU here (the pass is a no-op on a
    build without NCCL). Returns whether async TP is on for ``gm``."""
    if device is None or torch.device(device).type != "cuda" or not dist.is_nccl_available():
        return False
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    groups = {n.args[1] for n in gm.graph.nodes if collective_kind(n) in ("all_gather_rs_bwd", "reduce_scatter")}
    names = [ref[0] for ref in map(funcol_group, sorted(groups)) if ref is not None]
    for name in names:
        enable_symm_mem_for_group(name)
    return bool(names)


def _inductor(profile: dict) -> Callable:
    """A torch.compile backend: Inductor under ``profile``."""
    def backend(gm: torch.fx.GraphModule, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs, config_patches=profile)
    return backend


FALLBACK_ENV = "FXPAR_COMPILE_FALLBACK"  # "0": a stage that cannot be compiled raises instead of running eagerly


class CompiledStage:
    """Calls the compiled stage; on a failure to compile, warns once and calls the eager one from then on
    (or raises, with ``FXPAR_COMPILE_FALLBACK=0``)."""

    def __init__(self, gm: torch.fx.GraphModule, stage: int, backend: Callable):
        self.gm, self.stage = gm, stage
        self.compiled = torch.compile(gm, backend=backend, fullgraph=True, dynamic=False)
        self.failed: str | None = None  # why compiling failed, once it has
        self.code_made = False  # lazy GraphModules' forwards generated (fxpar.ir.program.graph_module)

    def __call__(self, *args):
        if self.failed is not None:
            return self.gm(*args)
        if not self.code_made:  # Dynamo traces the generated forwards: made once, before the first call
            for m in self.gm.modules():
                _LazyGraphModule.force_recompile(m)
            self.code_made = True
        try:
            with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
                return self.compiled(*args)
        except torch._dynamo.exc.TorchDynamoException as e:  # raised while compiling, before running
            if not run_options().compile_fallback:  # FXPAR_COMPILE_FALLBACK=0: fail, with the whole error
                raise
            self.failed = _reason(e)
            warnings.warn(f"fxpar: stage {self.stage} could not be compiled and runs eagerly ({self.failed})",
                          RuntimeWarning, stacklevel=2)
            return self.gm(*args)


def _reason(e: BaseException) -> str:
    """The root of a compile failure in one line (Inductor's errors wrap the backend's)."""
    inner = getattr(e, "inner_exception", None) or e.__cause__ or e
    lines = [ln.strip() for ln in str(inner).splitlines() if ln.strip()]
    return f"{type(inner).__name__}: {lines[0] if lines else ''}"[:300]


def compile_stage(gm: torch.fx.GraphModule, *, stage: int, lower: Callable | None,
                  device: torch.device | None = None) -> CompiledStage:
    """``gm`` (pipeline stage ``stage`` of this rank) compiled by Inductor under :func:`inductor_profile`
    on its first call; ``lower`` is ``fxpar.passes.lower_collectives.lower_collectives`` (None leaves
    fxpar's collectives opaque); ``device``: where it runs (CUDA turns on async TP, :func:`enable_async_tp`).
    Its backward is one autograd node: a zero-bubble schedule's ``I`` runs it whole and its ``W`` has
    nothing left to do. ``FXPAR_COMPILE_BACKEND=aot_eager``: Dynamo captures it and AOT autograd
    partitions it, without Inductor (fxpar's collectives stay opaque)."""
    if run_options().compile_backend == "aot_eager":  # FXPAR_COMPILE_BACKEND: the capture without Inductor
        return CompiledStage(gm, stage, "aot_eager")
    return CompiledStage(gm, stage, _inductor(inductor_profile(lower, async_tp=enable_async_tp(gm, device))))
