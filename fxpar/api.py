"""The public entry points ``trace`` and ``compile``: the one place that wires frontends, feasibility
checks, the mesh and its groups, the pass list, the cost model and the runtime.

``compile`` in order: the plan's checks (``fxpar.planner.feasibility``, before any communication), the
schedule, the device mesh and its process groups (the first communication), then a build callback the
runtime calls once per input signature: trace one microbatch, choose the cuts (first signature), run
the pass list (``fxpar.passes``), predict stage times (``fxpar.cost.predict``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from fxpar import launch, passes
from fxpar.cost.flops import annotate_costs
from fxpar.cost.memory import state_bytes
from fxpar.cost.partition import balanced_cuts, resolve_split_points
from fxpar.cost.predict import annotate_stages
from fxpar.cost.profiles import DeviceProfile
from fxpar.frontend.capture import capture_program
from fxpar.ir.batch import batch_size, split_batch
from fxpar.ir.errors import FxparError, PlanError
from fxpar.ir.mesh import MeshSpec
from fxpar.ir.optim import ParamGroups
from fxpar.ir.options import run_options
from fxpar.ir.plan import Plan
from fxpar.ir.program import Program
from fxpar.ir.quant_ops import HELD_BYTES
from fxpar.ir.schedule import build_schedule
from fxpar.ir.stage import CompileResult
from fxpar.passes.expert_parallel import router_load
from fxpar.planner import auto, feasibility
from fxpar.planner.stage_check import warn_pipeline
from fxpar.report.tp_coverage import warn_if_replicated
from fxpar.runtime import liveness
from fxpar.runtime.compile import compile_stage
from fxpar.runtime.grad_norm import check_max_grad_norm
from fxpar.runtime.groups import mesh_groups
from fxpar.runtime.memtrack import trim_heap
from fxpar.runtime.model import CompiledModel, PricedPlan
from fxpar.safetensors_check import check_weights
from fxpar.weights import WeightSource, check_not_taken


def trace(model: torch.nn.Module, example_args: tuple = (), example_kwargs: dict | None = None, *,
          frontend: str = "auto", dynamic: bool | dict = False, stack_traces: bool = False) -> Program:
    """Capture ``model`` into fxpar's IR.

    ``frontend``: ``"export"`` (torch.export, non-strict), ``"hf_fx"`` (transformers.utils.fx, where the
    installed transformers has it) or ``"auto"`` (export, then hf_fx if export fails and hf_fx exists).
    ``dynamic``: ``True`` makes the batch dim and the sequence dim of token inputs symbolic.
    ``stack_traces``: keep the user source line on every node (``node.meta["stack_trace"]``, export
    frontend); off by default because it costs about a tenth of the capture time of a large model.

    The returned :class:`Program` is called like the model and returns what the model returns; every
    node carries its FakeTensor (``val``), owning module (``fxpar.module``) and cost (``fxpar.cost``).
    """
    program = capture_program(model, example_args, example_kwargs, frontend=frontend, dynamic=dynamic,
                              stack_traces=stack_traces)
    annotate_costs(program)
    return program


class _Builder:
    """Compiles one input signature for this rank: trace one microbatch, cut, run the passes, predict.
    The :class:`fxpar.ir.build.Build` the runtime reads; ``priced``: a build without process groups (one
    only pricing its plan), whose pass list stops before Inductor."""

    def __init__(self, model, plan: Plan, mesh: MeshSpec, setup, actions, device, profile: DeviceProfile,
                 frontend: str, weights: WeightSource | None, groups: ParamGroups | None = None,
                 shape: tuple[int, int] | PlanError | None = None, priced: bool = False):
        self.model, self.plan, self.mesh, self.setup, self.actions = model, plan, mesh, setup, actions
        self.device, self.profile, self.frontend, self.weights = device, profile, frontend, weights
        self.priced = priced
        self.shape = shape  # the example batch's (global batch, length), or why it has none
        self._estimate = None  # what estimate() priced (or the PlanError it raised), once read
        self.dtype = auto.compute_dtype(model, plan)  # what the roofline prices the cuts and stage times in
        self.groups = groups  # the optimizer's parameter groups: ZeRO-3 buckets never mix them
        self.on_meta = any(p.is_meta for p in model.parameters())
        self.cuts: list[tuple[str, str]] | None = None
        self.shared: dict = {}  # tensors every signature shares (TP shards, ZeRO-3 shards, loaded weights)
        self.coverage_checked = False  # the TP coverage warning: once per compile, on rank 0

    def _load(self, fqns, layout, like):
        return self.weights.load(fqns, layout, like)

    @property
    def ep(self):
        """The expert-parallel pass's EpResult (None without ``Plan(ep=N)`` or before the first trace)."""
        return self.shared.get("ep")

    def predict_memory(self, trainable: int, states: int, frozen: int = 0) -> dict:
        """Parameter, gradient and optimizer-state bytes per rank (``fxpar.cost.memory.state_bytes``); the
        ``frozen`` entries' weights under ``"frozen"`` (QLoRA's base at its blocks' bytes per entry)."""
        plan = self.plan
        # ZeRO shards over dp x cp (HSDP: dp / dp_replicate x cp); cp ranks hold the same parameters
        return state_bytes(trainable, plan.zero, plan.dp * plan.cp, states, plan.dp_replicate, frozen,
                           HELD_BYTES[plan.base_dtype])

    def static_cache(self, batch: int, max_len: int):
        """A KV cache the model traces with (``CompiledModel.generate``), or None (fxpar.frontend.cache)."""
        from fxpar.frontend.cache import static_cache

        return static_cache(self.model, batch, max_len, "meta" if self.on_meta else self.device)

    def estimate(self):
        """``compiled.predicted``: :func:`fxpar.price` of the plan (the Estimate ``fxpar plan --plan`` prints
        and the planner ranks) for the example batch's global batch and length, on the profile the cuts were
        balanced on, computing in bf16 under ``mixed_precision="bf16"`` (else the model's dtype). Priced on
        the first call, which traces a shortened copy of the model (compile itself never pays for it), then
        kept; a PlanError where the plan cannot be priced (an example batch without ``[batch, seq]`` tokens)."""
        if self._estimate is None:
            try:
                if not isinstance(self.shape, tuple):
                    raise PlanError(f"compiled.predicted: no price for this plan: {self.shape}")
                batch, seq = self.shape
                self._estimate = auto.price(self.model, self.plan, device=self.profile, global_batch=batch, seq=seq,
                                            dtype="bf16" if self.plan.mixed_precision == "bf16" else None,
                                            frontend=self.frontend)
            except FxparError as e:  # the model's costs could not be read (a trace with token inputs failed)
                self._estimate = e if isinstance(e, PlanError) else PlanError(
                    f"compiled.predicted: fxpar.price cannot price this model: {str(e).splitlines()[0]}")
        if isinstance(self._estimate, PlanError):
            raise self._estimate
        return self._estimate

    def _compile_stage(self, gm, *, stage: int, lower):
        return compile_stage(gm, stage=stage, lower=lower, device=self.device)

    def context(self, setup) -> passes.PassContext:
        """What the passes read for a signature cut as ``setup`` (the cuts as chosen so far)."""
        return passes.PassContext(self.plan, self.mesh, self.device, cuts=self.cuts,
                                  stage_to_rank=list(setup.stage_to_rank),
                                  load=self._load if self.weights is not None else None,
                                  load_flat=self.weights.load_flat if self.weights is not None else None,
                                  traced_on_meta=self.on_meta,
                                  shared=self.shared, param_group=self.groups.index if self.groups else None,
                                  compile_stage=None if self.priced else self._compile_stage)

    def trace_first(self, flat: list, spec) -> Program:
        """The example batch's first microbatch, traced (on meta inputs for a meta model)."""
        mb = split_batch(flat, self.setup.batch, self.setup.microbatches * self.setup.dp)[0]
        if self.on_meta:
            mb = [v.to("meta") if isinstance(v, torch.Tensor) else v for v in mb]
        return trace(self.model, *pytree.tree_unflatten(mb, spec), frontend=self.frontend)

    def setup_for(self, batch: int) -> feasibility.PipelineSetup:
        """The pipeline set-up for a global ``batch`` (checked: a PlanError before any communication)."""
        return self.setup if batch == self.setup.batch else feasibility.pipeline_setup(self.plan, batch)

    def __call__(self, flat: list, spec, setup: feasibility.PipelineSetup,
                 program: Program | None = None) -> CompileResult:
        plan = self.plan
        mb = split_batch(flat, setup.batch, setup.microbatches * setup.dp)[0]  # setup.dp: dp x ep replicas
        if self.on_meta:  # a meta model is traced on meta inputs
            mb = [v.to("meta") if isinstance(v, torch.Tensor) else v for v in mb]
        if program is None:
            program = trace(self.model, *pytree.tree_unflatten(mb, spec), frontend=self.frontend)
        else:
            feasibility.check_program(program, self.model, setup)
        if self.on_meta and not self.priced:
            feasibility.check_meta_constants(program, plan)
        if self.cuts is None:
            if plan.split_points:
                self.cuts = resolve_split_points(program, plan.split_points)
                feasibility.check_split_points(self.cuts, plan, setup.n_stages)
            else:
                self.cuts = balanced_cuts(program, setup.n_stages, self.profile, self.dtype)
            if self.mesh.rank == 0:  # stages nearly empty or a large bubble: the numbers and a better plan, once
                warn_pipeline(program, self.cuts, plan, setup, self.profile, self.dtype)
        ctx = self.context(setup)
        local, pipeline = passes.run(program, ctx)
        if not self.coverage_checked and self.mesh.rank == 0:  # a plan leaving big weights whole says so once
            self.coverage_checked = True
            warn_if_replicated(program.params, ctx.out.tp)
        if self.weights is not None:
            self.weights.done()
            # a model whose tensors compile took (ZeRO-3): what it did not keep is freed now
            self.weights.release({a for info in program.params.values() for a in info.fqns})
        tied = feasibility.tied_across_ranks(pipeline, setup.stage_to_rank)  # frozen copies never drift apart
        feasibility.check_zero3_ties(plan, [f for f in tied if program.params[f].requires_grad])
        # priced on this rank's program: after TP its nodes cost their shards (the TP pass prices them)
        predicted = annotate_stages(local, pipeline, self.cuts, self.profile, self.dtype)
        return CompileResult(program, local, pipeline, ctx.out.tp, ctx.out.zero3_buckets, predicted, ctx.out.timings,
                             ctx.out.stage_fns)


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def compile(model: torch.nn.Module, plan: Plan | str, example_args: tuple = (), example_kwargs: dict | None = None,
            *, optimizer=None, device=None, profile: DeviceProfile | str | None = None, frontend: str = "auto",
            timeout: float | None = None, program: Program | None = None, weights=None,
            max_grad_norm: float | None = None, param_groups=None, device_model=None) -> CompiledModel:
    """Compile ``model`` for ``plan`` on this rank (call it on every rank with the same arguments).

    ``plan``: a :class:`Plan`, its text (``"dp=2,pp=2"``) or ``"auto"``: every rank chooses the same plan
    with :func:`fxpar.autoplan` for the process group's world, the example batch's global batch and length
    and this device's profile (:func:`fxpar.cost.profiles.profile_for_device`), checked across the ranks
    once the group exists; rank 0 prints it; ``compiled.autoplan`` holds the ranked alternatives.

    ``example_kwargs`` is one full batch (labels included for training); ``optimizer`` a factory
    ``params -> torch.optim.Optimizer`` applied to the parameters this rank holds. ``timeout``: seconds a
    rank waits for a peer before failing with a message that names it (default 300, or
    ``FXPAR_TIMEOUT``). ``program``: an ``fxpar.trace`` of ``model`` on one microbatch, to compile one
    trace for several plans without tracing again. ``weights``: for a model built on the meta device,
    where each rank's shards come from: a state dict with the model's FQNs, safetensors path(s), or
    ``"init"`` (the model's initialiser); see :mod:`fxpar.weights`. Under ZeRO-3 (``zero=3``) a rank holds
    only its shards: with ``weights=`` each rank reads only its slices; a model built on a device has its
    tensors taken (:meth:`fxpar.weights.WeightSource.taking`): the module is left with meta tensors of the
    same shapes (ties kept) and the full tensors are freed once sharded, as FSDP2's ``fully_shard`` frees
    them; compiling the same module again then needs ``weights=``.

    Under torchrun without a process group, ``compile`` joins it (:func:`fxpar.launch.init_distributed`);
    ``device=None`` is where the model's weights are, or for a meta-device model the device
    :func:`fxpar.launch.device_for_rank` picks (``cuda:<LOCAL_RANK>``, or the CPU). A peer that dies makes every
    other rank raise :class:`fxpar.runtime.liveness.PeerFailure` naming it, within the timeout.

    ``profile``: the device profile (:class:`~fxpar.cost.profiles.DeviceProfile`, a profile name such as
    ``"h100-80gb"`` or a ``fxpar calibrate`` JSON path) the pipeline cuts are balanced and the stage times
    predicted on; None: this device's (:func:`fxpar.planner.auto.device_profile`), under ``"auto"`` the one the plan
    was priced on. ``device_model=`` is its deprecated spelling (a DeviceProfile; one release).

    ``max_grad_norm``: every ``step`` clips the global L2 norm of the gradients (all TP shards, stages and
    ZeRO shards, each entry once) to it after their sync, as ``torch.nn.utils.clip_grad_norm_`` before the
    optimizer step; ``float('inf')`` only measures it. The norm before clipping is
    ``compiled.last_grad_norm`` (see :mod:`fxpar.runtime.grad_norm`).

    ``param_groups``: ``rule(fqn, param) -> dict``, the options of the optimizer parameter group a parameter
    belongs to (``{}``: the factory's defaults; ``fxpar.ir.optim.decay_rule(0.01)``: HF Trainer's weight
    decay, none on biases and norms); it sees each parameter once, under its canonical FQN, whole (meta is
    fine). Parameters with equal options share a group; the factory then gets torch's group form
    ``[{"params": [...], **options}, ...]`` with every group of the model in order of first appearance, on
    every rank the same list (a group this rank holds nothing of has no params), ZeRO flat shards in their
    bucket's group (ZeRO buckets never mix groups). Without it the factory gets a plain list.
    """
    check_max_grad_norm(max_grad_norm)  # before any communication
    profile = auto.profile_arg(profile, device_model)
    groups = ParamGroups.from_rule(model, param_groups) if param_groups is not None else None
    is_auto = isinstance(plan, str) and plan.strip().lower() == "auto"
    if is_auto:  # the same plan on every rank (pure), before any communication; checked across ranks below
        device = device if device is not None else launch.device_for_model(model)
        chosen = auto.plan_for_compile(model, example_args, dict(example_kwargs or {}), world=launch.world_size(),
                                       device=device, optimizer=optimizer, frontend=frontend)
        plan = chosen.best
        if profile is None:  # the pipeline cuts balanced on the profile the plan was priced on
            profile = chosen.profile
    plan = Plan.parse(plan) if isinstance(plan, str) else plan
    if plan.fused_loss:  # the fused loss's kernels (loaded on demand: the module imports triton)
        import fxpar.runtime.kernels.cross_entropy  # noqa: F401
    if plan.collective_matmul:  # the collective matmul's kernels
        import fxpar.runtime.kernels.collective_matmul  # noqa: F401
    check_weights(weights)  # a bad safetensors file named before this rank joins the process group
    timeout = float(timeout) if timeout is not None else run_options().timeout  # FXPAR_TIMEOUT, read once
    if launch.launched_by_torchrun() and not dist.is_initialized():
        launch.check_launch_world(plan)  # a world the plan does not fit: before joining
        launch.init_distributed(timeout)  # torchrun started us, the script did not join: join here
    liveness.start()  # a no-op on one rank, or when init_distributed started it
    world, rank = _world()
    if is_auto:
        launch.check_same_plan(plan, world)  # the first communication: every rank chose the same plan
        auto.announce(chosen, rank)
    feasibility.check_world(plan, world)
    device = device if device is not None else launch.device_for_model(model)
    # cuts balanced and stage times predicted on this device's profile (fxpar.planner.auto.device_profile)
    profile = profile if profile is not None else auto.device_profile(torch.device(device))[0]
    mesh = MeshSpec.for_plan(plan, rank)
    with liveness.guard("compile"):
        check_not_taken(model, weights)
        builder, actions, program = _prepare(model, plan, mesh, example_args, example_kwargs, optimizer=optimizer,
                                             device=device, profile=profile, frontend=frontend, program=program,
                                             weights=weights, priced=False, groups=groups)
        device = builder.device
        # this rank's process groups (they communicate)
        device_mesh = None if mesh.world_size == 1 else mesh_groups(mesh, device.type, builder.setup.dp_axis)
        compiled = CompiledModel(builder, model, plan, mesh, actions, example_args, example_kwargs, optimizer,
                                 device=device, timeout=timeout, device_mesh=device_mesh, program=program,
                                 max_grad_norm=max_grad_norm, param_groups=groups)
    compiled.autoplan = chosen if is_auto else None  # the ranked alternatives, for inspection
    trim_heap()  # what compiling freed goes back to the system, not kept as the heap's high-water mark
    return compiled


def price(model: torch.nn.Module, plan: Plan | str, example_args: tuple = (), example_kwargs: dict | None = None,
          *, rank: int = 0, optimizer=None, profile: DeviceProfile | str | None = None, frontend: str = "auto",
          weights=None, param_groups=None, device_model=None) -> PricedPlan:
    """What ``plan`` does on rank ``rank`` of its world, built on this one process without any process
    group: the priced plan (:class:`~fxpar.runtime.model.PricedPlan`): stages, placements, collectives,
    buckets, memory and predicted times (``predicted``: the Estimate the planner ranks; ``fxpar.inspect``
    reads them all). It has nothing to run: the pass list stops before Inductor. ``profile``: the device
    profile the cuts are balanced and the times predicted on, as ``compile``'s (None: this machine's profile,
    :func:`fxpar.planner.auto.device_profile`; ``device_model=``: its deprecated spelling)."""
    plan = Plan.parse(plan) if isinstance(plan, str) else plan
    profile = auto.profile_arg(profile, device_model, "fxpar.api.price")
    profile = profile if profile is not None else auto.device_profile(None)[0]
    mesh = MeshSpec.for_plan(plan, rank)
    groups = ParamGroups.from_rule(model, param_groups) if param_groups is not None else None
    builder, actions, program = _prepare(model, plan, mesh, example_args, example_kwargs, optimizer=optimizer,
                                         device=None, profile=profile, frontend=frontend, program=None,
                                         weights=weights, priced=True, groups=groups)
    priced = PricedPlan(builder, model, plan, mesh, actions, example_args, example_kwargs, optimizer,
                        device=builder.device, program=program, param_groups=groups)
    if plan.ep > 1 and not priced.build.on_meta:  # the experts' load the example batch gives (ep.stats)
        priced.ep.set_load(_expert_load(priced, example_args, example_kwargs))
    return priced


def _expert_load(priced: PricedPlan, example_args, example_kwargs) -> dict:
    """Per MoE layer, ``[ep, E]``: the tokens each replica of ``priced``'s ep group routes to each expert in
    the example batch, from the traced program run on this process (``fxpar.passes.expert_parallel``)."""
    program, spec, m = priced.result.traced, priced.spec, priced.m
    flat = program.flatten_inputs(tuple(example_args), dict(example_kwargs or {}))
    mbs = split_batch(flat, batch_size(flat), spec.replicas * m)
    first = spec.dp_rank * spec.ep * m  # this rank's ep group: replicas dp_rank * ep + e, m microbatches each
    counts = router_load(program, spec.ep, mbs[first:first + spec.ep * m])
    return {layer: c.view(spec.ep, m, -1).sum(1) for layer, c in counts.items()}


def _prepare(model, plan: Plan, mesh: MeshSpec, example_args, example_kwargs, *, optimizer, device, profile,
             frontend, program, weights, priced: bool, groups: ParamGroups | None = None) -> tuple:
    """(the builder, the schedule's actions, the first trace or ``program``) for rank ``mesh.rank``, every
    check done and nothing communicated. ``priced``: for :func:`price` (no tensor taken, no Inductor)."""
    example_kwargs = dict(example_kwargs or {})
    feasibility.check_optimizer_factory(plan, optimizer, groups)
    feasibility.warn_zero_with_pipeline(plan)
    device = torch.device(device) if device is not None else torch.device("cpu")
    flat, _ = pytree.tree_flatten((tuple(example_args), example_kwargs))
    setup = feasibility.pipeline_setup(plan, batch_size(flat))
    actions = build_schedule(setup.schedule, plan.pp, setup.microbatches, setup.n_stages)
    source = WeightSource(model, weights, rank=mesh.tp_rank) if weights is not None else None
    if plan.zero == 3 and source is None and not priced and _materialised(model):
        # ZeRO-3 holds only its shards: the model's tensors are read as weights= would be, and freed
        source = WeightSource.taking(model, rank=mesh.tp_rank)
    try:  # the example batch's shape, for compiled.predicted (priced when read)
        shape = auto.example_shape(example_args, example_kwargs)
    except PlanError as e:
        shape = e
    builder = _Builder(model, plan, mesh, setup, actions, device, profile, frontend, source, groups, shape,
                       priced=priced)
    # EP's and QLoRA's preconditions, on the first trace (compile reuses it), before any communication
    if plan.ep > 1 or plan.base_dtype is not None:
        if program is None:
            program = builder.trace_first(flat, pytree.tree_flatten((tuple(example_args), example_kwargs))[1])
        passes.check(program, builder.context(setup))
    return builder, actions, program


def _materialised(model: torch.nn.Module) -> bool:
    tensors = [*model.parameters(), *model.buffers()]
    return bool(tensors) and not any(t.is_meta for t in tensors)

