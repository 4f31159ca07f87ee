"""``PricedPlan``: a plan compiled for one rank (what the API's ``price`` returns); ``CompiledModel``: a
priced plan that runs training steps and inference.

``CompiledModel`` is a facade over small parts: the batch cut into microbatches (``fxpar.ir.batch``), the
program cache, the pipeline runtime, the training step (``fxpar.runtime.train_step``: the data-parallel
engine (DDP / ZeRO-1/2) or the optimizer, the tied gradients, the gradient-norm clipping between the
gradients' sync and the optimizer step), ZeRO-3's regathering (``fxpar.runtime.zero3``), the inference
outputs' gathering and the full-state gathering (``fxpar.runtime.state``). What to run comes from
``build`` (:class:`fxpar.ir.build.Build`, made by ``fxpar.compile``), which traces one input signature and
runs the pass list on it, Inductor included: one :class:`~fxpar.ir.stage.CompileResult` per signature,
cached on the pytree structure *and* every tensor's shape and dtype (``fxpar.runtime.programs``), so a
graph traced for one shape never runs on another; each microbatch is checked against its program's
traced shapes as well. This rank's coordinates are its :class:`~fxpar.ir.mesh.MeshSpec`'s.

Every rank calls ``step``/``__call__`` with the same full (global) batch: each data-parallel replica
takes its slice, and only the stages a rank runs read it (the first stage its input ids, the last its
labels), so no input travels.
"""

from __future__ import annotations

import torch

from fxpar.ir.batch import batch_size, check_shapes, loss_weights, split_batch
from fxpar.ir.build import Build
from fxpar.ir.errors import PlanError
from fxpar.ir.mesh import MeshSpec
from fxpar.ir.optim import ParamGroups, make_optimizer, state_count
from fxpar.ir.plan import Plan
from fxpar.ir.program import Program
from fxpar.ir.resolved import dp_bucket_bytes
from fxpar.ir.stage import CompileResult, PipelineProgram
from fxpar.runtime.data_parallel import DataParallelEngine, held_bytes
from fxpar.runtime.expert_parallel import ExpertParallelRecord
from fxpar.runtime.generate import generate
from fxpar.runtime.grad_norm import make_clipper
from fxpar.runtime.liveness import guarded
from fxpar.runtime.pipeline import PipelineRuntime
from fxpar.runtime.programs import ProgramCache
from fxpar.runtime.state import canonical_names, full_state_dict
from fxpar.runtime.tied import make_tied_groups
from fxpar.runtime.train_step import TrainingStep, gather_outputs
from fxpar.runtime.view import rank_view
from fxpar.runtime.zero3 import Zero3Gatherer, Zero3Regather


class PricedPlan:
    """A plan compiled for one rank, without running anything: its training signature's
    :class:`~fxpar.ir.stage.CompileResult`, this rank's parameters' data-parallel layout and optimizer, and
    the plan's price (``predicted``, ``memory()``). What the API's ``price`` returns (built with no
    process group) and what ``fxpar.inspect``, checkpoints and the planner read; :class:`CompiledModel`
    adds running it.

    ``runtime(result)``: what executes each signature's result (None: nothing runs); ``create_groups``:
    whether the tied parameters' process groups are made (they communicate)."""

    def __init__(self, build: Build, model: torch.nn.Module, plan: Plan, mesh: MeshSpec, actions,
                 example_args, example_kwargs, optimizer, *, device: torch.device, program: Program | None = None,
                 param_groups: ParamGroups | None = None, runtime=None, create_groups: bool = False):
        setup = build.setup
        self.model, self.plan, self.spec, self.setup, self.device = model, plan, mesh, setup, device
        self.schedule = actions  # the pipeline schedule's actions per rank (fxpar.ir.schedule)
        self.build = build  # compiles each signature (fxpar.ir.build.Build); the runtime reads nothing else of it
        self.programs = ProgramCache(build, build.setup_for, runtime or (lambda result: None))  # one per shapes
        self._train = self.programs.get(example_args, example_kwargs, program)[0]
        self._tied_groups = make_tied_groups(self._train.pipeline, mesh, self.stage_to_rank, create=create_groups,
                                             program=self._train.program)
        self._named = self._my_named_parameters(self._train.pipeline)
        # Plan(ep=N): what the EP pass cut, the last step's all-to-all bytes and experts' loads
        self.ep = ExpertParallelRecord(build.ep, self._train.program)
        self.engine, self.optimizer = make_engine(self._named, optimizer, param_groups, self._train, plan, mesh,
                                                  overlap=not self._tied_groups, experts=self.ep.expert_ids)

    # this rank's coordinates and the batch's cut, read from the MeshSpec and the set-up that keep them
    world = property(lambda self: self.spec.world_size)
    rank = property(lambda self: self.spec.rank)
    dp = property(lambda self: self.spec.replicas, doc="data replicas: dp x ep with expert parallelism")
    tp = property(lambda self: self.spec.tp)
    pp_rank = property(lambda self: self.spec.pp_rank)
    dp_rank = property(lambda self: self.spec.replica_rank, doc="this rank's replica (each ep rank its own)")
    tp_rank = property(lambda self: self.spec.tp_rank)
    m = property(lambda self: self.setup.microbatches, doc="microbatches per replica")
    schedule_name = property(lambda self: self.setup.schedule)
    stage_to_rank = property(lambda self: list(self.setup.stage_to_rank))

    def _my_named_parameters(self, pipeline: PipelineProgram) -> list[tuple[str, torch.nn.Parameter]]:
        """(name in its stage, parameter) for the stages this rank runs, each parameter once."""
        seen, out = set(), []
        for stage in pipeline.stages_of(self.pp_rank):
            for n, p in stage.gm.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append((n, p))
        return out

    def memory(self) -> dict[str, dict[str, int]]:
        """Bytes this rank holds for parameters, gradients and optimizer states: ``predicted`` from parameter counts
        (fp32 master weights; frozen ones weights alone, under ``"frozen"``); ``measured`` from the tensors once a
        step has run (never for a priced plan)."""
        program, n = self._train.program, [0, 0]
        for s in self._train.pipeline.stages_of(self.pp_rank):  # tensors of each stage, whole: trainable, frozen
            for t in {id(t): t for t in map(program.tensor, s.params)}.values():
                n[not t.requires_grad] += t.numel()
        out = {"predicted": self.build.predict_memory(n[0], state_count(self.optimizer), n[1])}
        measured = self._measured()
        if measured is not None:
            out["measured"] = measured
        return out

    def _measured(self) -> dict[str, int] | None:
        return None  # nothing ran

    @property
    def cuts(self) -> list[tuple[str, str]]:
        """The pipeline cuts (chosen on the first trace, kept for every later signature)."""
        return self.build.cuts

    @property
    def pipeline(self) -> PipelineProgram:
        return self._train.pipeline

    @property
    def program(self) -> Program:
        return self._train.program

    @property
    def result(self) -> CompileResult:
        """What compile produced for the training signature (typed; read by inspection and checkpoints)."""
        return self._train

    @property
    def tp_info(self):
        """The TP pass's result for this rank (which parameters it sharded, their layouts; empty without TP)."""
        return self._train.tp

    @property
    def predicted(self):  # fxpar.price's Estimate of the plan for the example batch, priced on first read
        return self.build.estimate()

    view = rank_view  # what inspection reads of it: a typed RankView (fxpar.runtime.view)

    @property
    def zero3_buckets(self) -> dict[int, list]:
        return self._train.zero3_buckets


class CompiledModel(PricedPlan):
    """A model compiled for one plan, on this rank: a :class:`PricedPlan` that runs training steps
    (``step``), inference (``__call__``, ``generate``) and gathers the full state. See :func:`fxpar.compile`."""

    def __init__(self, build: Build, model: torch.nn.Module, plan: Plan, mesh: MeshSpec, actions,
                 example_args, example_kwargs, optimizer, *, device: torch.device, timeout: float,
                 device_mesh=None, program: Program | None = None,
                 max_grad_norm: float | None = None, param_groups: ParamGroups | None = None):
        self.mesh = device_mesh  # torch's DeviceMesh (None on one rank)
        self.timeout = timeout
        super().__init__(build, model, plan, mesh, actions, example_args, example_kwargs, optimizer, device=device,
                         program=program, param_groups=param_groups, runtime=self._runtime, create_groups=True)
        clipper = make_clipper(max_grad_norm, self._train, mesh, self._named, self.engine, device,
                               self.ep.info.experts if self.ep.info is not None else ())
        self.training = TrainingStep(mesh, device, self.engine, self.optimizer, clipper, self._tied_groups, self.ep)

    clipper = property(lambda self: self.training.clipper)
    steps = property(lambda self: self.training.steps, doc="training steps run")

    # ---- building ----------------------------------------------------------------------------------
    def _runtime(self, result: CompileResult) -> PipelineRuntime:
        stage_fns = result.stage_fns or None  # Plan.compile: what the inductor pass made of this rank's stages
        return PipelineRuntime(
            result.pipeline, self.schedule, self.pp_rank, self.spec.pipeline_ranks(), None, self.device, self.timeout,
            forward_context=Zero3Regather if self.plan.zero == 3 else None,
            autocast_dtype=torch.bfloat16 if self.plan.mixed_precision == "bf16" else None, stage_fns=stage_fns)

    # ---- running -----------------------------------------------------------------------------------
    def _microbatches(self, result: CompileResult, setup, args, kwargs) -> list[list]:
        """Every data-parallel rank's microbatches of the global batch, dp rank-major (rank d owns
        ``[d * m, (d + 1) * m)``), each checked against the shapes its program was traced for."""
        flat = result.program.flatten_inputs(tuple(args), dict(kwargs))
        batch = batch_size(flat)
        if batch != setup.batch:
            raise PlanError(f"batch of {batch} given to a program compiled for {setup.batch}")
        mbs = split_batch([v.to(self.device) if isinstance(v, torch.Tensor) else v for v in flat],
                          batch, self.dp * self.m)
        check_shapes(result.traced, mbs[0])
        return mbs

    def _mine(self, mbs: list) -> list:
        return mbs[self.dp_rank * self.m:(self.dp_rank + 1) * self.m]

    @guarded("a training step")  # every entry point that waits on peers names a peer that died
    def step(self, *args, **kwargs) -> torch.Tensor:
        """Forward and backward over the microbatches, gradient sync, optimizer step; the batch's loss."""
        result, runtime, setup = self.programs.get(args, kwargs)
        if result.pipeline.loss_output is None:
            raise PlanError("the model returned no loss for these inputs: pass labels (or whatever makes "
                            f"{type(self.model).__name__} compute its loss)")
        every = self._microbatches(result, setup, args, kwargs)
        weights = self._mine(loss_weights(result.program, every, self.model))  # shares of the global batch
        params = [p for _, p in self._my_named_parameters(result.pipeline)]
        return self.training.run(result, runtime, self._mine(every), weights, params, self.programs.last_key)

    @guarded("an inference forward")
    @torch.no_grad()
    def __call__(self, *args, **kwargs):
        """Inference: forward over the microbatches; the model's outputs, gathered on every rank."""
        result, runtime, setup = self.programs.get(args, kwargs)
        every = self._microbatches(result, setup, args, kwargs)
        out = runtime.run(self._mine(every), train=False)  # outputs are exchanged by gather_outputs
        m, loss = self.m, result.pipeline.loss_output
        return gather_outputs(result, out, self.spec, m, self.device, lambda j: (
            self._mine(loss_weights(result.program, every, self.model)) if j == loss else [1 / (m * self.dp)] * m))

    generate = generate  # greedy or sampled decoding, the same tokens on every rank (fxpar.runtime.generate)

    # ---- reading -----------------------------------------------------------------------------------
    @property
    def last_grad_norm(self) -> float | None:
        """The last ``step``'s global gradient norm before clipping (as ``clip_grad_norm_`` returns it),
        the same on every rank; None without ``max_grad_norm`` or before the first step."""
        return self.clipper.last_norm() if self.clipper is not None else None

    @guarded("gathering the full state")
    def full_state_dict(self, grads: bool = False, names=None) -> dict[str, torch.Tensor]:
        """Full tensors keyed by the original FQNs (tied parameters under each name), on every rank.
        ``grads=True``: the parameters' gradients from the last ``step`` instead (zeros where none);
        ``names``: only these (the same on every rank)."""
        zero3 = Zero3Gatherer(self._train.zero3_buckets, canonical_names(self._train.program),
                              self.spec.shard_group_name(), self.spec.dp_shard, grads) if self.plan.zero == 3 else None
        return full_state_dict(self._train, self.model, self.spec, self.device, grads, ep=self.ep.info, zero3=zero3,
                               names=names)

    def _measured(self) -> dict[str, int] | None:
        """This rank's held bytes once a step has run (the engine's, or its parameters' and optimizer's)."""
        if not self.steps:
            return None
        return self.engine.memory() if self.engine is not None else held_bytes(
            [p for _, p in self._my_named_parameters(self._train.pipeline)], self.optimizer)


def make_engine(named, factory, groups: ParamGroups | None, result: CompileResult, plan: Plan, mesh: MeshSpec,
                overlap: bool, experts: set[int] = frozenset()):
    """(the data-parallel engine or None, the optimizer or None) for this rank's parameters ``named``. With
    ``groups``, each parameter's group is its FQN's (a ZeRO-3 flat shard's: its bucket's, one group).
    ``experts``: ids of expert slices (``Plan(ep=N)``): reduced over the dp group, every other parameter
    over all ``dp x ep`` replicas."""
    group_of = None
    if groups is not None:
        # trained buckets only: a frozen one is no optimizer's (QLoRA's codes and scales are no model parameter)
        trained = [b for bs in result.zero3_buckets.values() for b in bs if b.shard.requires_grad]
        canonical = {id(b.shard): b.names[0] for b in trained}
        mixed = [b.names for b in trained if len(set(map(groups.index, b.names))) > 1]
        if mixed:  # the ZeRO-3 pass splits buckets by group; a mixed one would step some entries wrongly
            raise RuntimeError(f"fxpar.runtime.model: ZeRO-3 buckets {mixed[:2]} mix optimizer parameter groups")
        group_of = {id(p): groups.index(canonical.get(id(p), n)) for n, p in named if p.requires_grad}
    if mesh.grad_size > 1 or plan.zero:
        expert_group = (mesh.grad_group_name(experts=True), mesh.dp * mesh.cp, mesh.dp_rank * mesh.cp + mesh.cp_rank)
        dense_group = (mesh.grad_group_name(), mesh.grad_size, mesh.grad_rank)
        if mesh.dp_replicate > 1:  # HSDP (ep=1): shards over the shard group, each shard's copies over replicas
            dense_group = (mesh.shard_group_name(), mesh.dp_shard, mesh.dp_shard_rank)
        engine = DataParallelEngine(named, factory, dp=dense_group[1], rank=dense_group[2], zero=plan.zero,
                                    group=dense_group[0], bucket_bytes=dp_bucket_bytes(plan),
                                    overlap=overlap, offload=plan.offload, param_groups=groups, group_of=group_of,
                                    reduce_group=(lambda p: expert_group if id(p) in experts else dense_group)
                                    if experts else None,
                                    replicate=(mesh.replicate_group_name(), mesh.dp_replicate))
        return engine, engine.optimizer
    # a rank whose stages hold no parameter (possible with tiny models) has nothing to optimise; a frozen one
    # (requires_grad=False) is no optimizer's
    mine = [p for _, p in named if p.requires_grad]
    return None, make_optimizer(factory, mine, groups, [group_of[id(p)] for p in mine] if groups else None)
