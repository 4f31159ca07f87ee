"""``fxpar.compile``: trace, plan, split and run a model as a distributed program on every rank.

Every rank calls ``compile`` with the same model (or a meta-device one with the same structure), the
same plan and example inputs, and then ``step``/``__call__`` with the same full batch: only the stages
a rank runs read it (the first stage its input ids, the last its labels), so no input travels.

Order of work in ``compile``, all before any communication: validate the plan against the world and
the batch; trace one microbatch; choose cuts; place stages on ranks; build the schedule. Then the
only collective: process groups for parameters shared between stages on different ranks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from fxpar.api import trace
from fxpar.cost.device import H100, DeviceModel
from fxpar.cost.partition import (
    StageCost,
    balanced_cuts,
    candidate_modules,
    cut_positions,
    resolve_split_points,
    stage_costs,
)
from fxpar.ir.errors import PlanError
from fxpar.ir.plan import Plan
from fxpar.ir.program import Program
from fxpar.ir.stage import PipelineProgram
from fxpar.passes.pipeline_split import loss_position, set_nested, split_pipeline
from fxpar.passes.tensor_parallel import tensor_parallel, unshard
from fxpar.runtime import ops as fxops
from fxpar.runtime import schedules as sched
from fxpar.runtime.pipeline import PipelineRuntime
from fxpar.weights import WeightSource


@dataclass
class _Compiled:
    """One traced signature (training with labels, or inference) split into stages."""

    program: Program
    pipeline: PipelineProgram
    runtime: PipelineRuntime


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def _batch_size(flat: list) -> int:
    for v in flat:
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            return v.shape[0]
    raise PlanError("no tensor input with a batch dimension: fxpar needs one to cut microbatches")


def _traced_batch(program: Program) -> int:
    """The batch size a program was traced with (dim 0 of its first user tensor input)."""
    users = {b.placeholder for b in program.inputs if b.kind == "user"}
    return _batch_size([n.meta.get("val") for n in program.graph.nodes if n.name in users])


def _split_batch(flat: list, batch: int, m: int) -> list[list]:
    """Cut every tensor whose dim 0 is the batch into ``m`` microbatches; other values are shared."""
    out = [[] for _ in range(m)]
    for v in flat:
        if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == batch:
            for i, piece in enumerate(v.chunk(m, dim=0)):
                out[i].append(piece)
        else:
            for i in range(m):
                out[i].append(v)
    return out


def _loss_weights(program: Program, microbatches: list[list], model: torch.nn.Module) -> list[float]:
    """Each microbatch's share of the whole batch's mean loss: its count of counted label tokens.

    HF losses average over label tokens that are not ``-100``; causal LMs shift labels by one first.
    Which loss a model uses is decided as transformers decides it: ``model.loss_type``, else the class
    name's task suffix. Without labels, microbatches weigh the same.
    """
    flat_keys = _flat_kwarg_names(program)
    if "labels" not in flat_keys:
        return [1.0 / len(microbatches)] * len(microbatches)
    idx = flat_keys.index("labels")
    loss_type = getattr(model, "loss_type", None) or type(model).__name__
    shift = loss_type.endswith("ForCausalLM")
    counts = []
    for mb in microbatches:
        labels = mb[idx]
        if shift:
            labels = labels[..., 1:]
        counts.append(int((labels != -100).sum()))
    total = sum(counts)
    if total == 0:
        raise PlanError("every label is -100: the batch has no token to compute a loss on")
    return [c / total for c in counts]


def _flat_kwarg_names(program: Program) -> list[str]:
    """The name of each flattened user input (positional ones as 'arg<i>')."""
    args_spec, kwargs_spec = program.in_spec.children()
    names = [f"arg{i}" for i in range(args_spec.num_leaves)]
    for key, child in zip(kwargs_spec.context or [], kwargs_spec.children()):
        names.extend([key] * child.num_leaves)
    return names


def _retarget_device(gms: list[torch.fx.GraphModule], device: torch.device) -> None:
    """A graph traced on the meta device names it in factory calls (``arange(..., device=meta)``):
    point those at the device the materialised tensors live on."""
    meta_device = torch.device("meta")

    def fix(v):
        return device if isinstance(v, torch.device) and v == meta_device else v

    for root in gms:
        for gm in [m for m in root.modules() if isinstance(m, torch.fx.GraphModule)]:
            for node in gm.graph.nodes:
                node.args = pytree.tree_map(fix, node.args)
                node.kwargs = pytree.tree_map(fix, node.kwargs)
            gm.recompile()


class CompiledModel:
    """A model compiled for one plan, on this rank. See :func:`compile`."""

    def __init__(self, model, plan: Plan, example_args, example_kwargs, optimizer, *, device,
                 device_model: DeviceModel, frontend: str, timeout: float, program: Program | None = None,
                 weights=None):
        self.model, self.plan, self.device_model, self.frontend = model, plan, device_model, frontend
        self.timeout = timeout
        self.world, self.rank = _world()
        if plan.world_size != self.world:
            raise PlanError(f"plan dp={plan.dp} x pp={plan.pp} x tp={plan.tp} needs {plan.world_size} ranks, but the "
                            f"world has {self.world}; launch with torchrun --nproc_per_node {plan.world_size} or "
                            "change the degrees")
        if plan.dp > 1 or plan.zero:
            raise PlanError("this fxpar build runs pipeline and tensor parallelism (dp=1, zero=0); data "
                            "parallelism and ZeRO are not part of it yet")
        # ranks: TP innermost (it stays within a node), then PP: rank = pp_rank * tp + tp_rank
        self.tp, self.tp_rank, self.pp_rank = plan.tp, self.rank % plan.tp, self.rank // plan.tp
        self.pp_ranks = [p * plan.tp + self.tp_rank for p in range(plan.pp)]  # my pipeline's global ranks
        self.tp_info: dict = {"sharded": {}, "pieces": {}}
        self._tp_shards: dict[str, torch.Tensor] = {}  # this rank's TP shards, shared by every signature
        self.schedule_name = sched.normalize_schedule(plan.schedule)
        v = sched.stages_per_rank(self.schedule_name, plan.virtual_stages)
        self.n_stages = plan.pp * v
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        flat, _ = pytree.tree_flatten((tuple(example_args), dict(example_kwargs)))
        self.batch = _batch_size(flat)
        self.m = plan.microbatches or self.n_stages
        if self.batch % self.m:
            raise PlanError(f"batch of {self.batch} does not divide into {self.m} microbatches; global batch = "
                            f"microbatch size x microbatches x dp ({plan.dp}): pick a batch that is a multiple "
                            f"of {self.m * plan.dp} or another number of microbatches")
        sched.validate(self.schedule_name, plan.pp, self.m, self.n_stages)
        self.schedule = sched.build_schedule(self.schedule_name, plan.pp, self.m, self.n_stages)
        self.stage_to_rank = sched.stage_to_rank(self.schedule_name, plan.pp, self.n_stages)
        self._signatures: dict[tuple, _Compiled] = {}
        self.weights = WeightSource(model, weights) if weights is not None else None
        self._loaded: dict[str, torch.Tensor] = {}  # FQN -> tensor materialised from ``weights``
        self.cuts: list[tuple[str, str]] | None = None
        if plan.tp > 1:  # the only collective before tracing: every rank creates every TP group
            fxops.new_subgroups("tp", [[p * plan.tp + t for t in range(plan.tp)] for p in range(plan.pp)])
        self.train = self._compile(example_args, example_kwargs, program)
        self._tied_groups = self._make_tied_groups(self.train.pipeline)
        mine = self._my_parameters(self.train.pipeline)
        # a rank whose stages hold no parameter (possible with tiny models) has nothing to optimise
        self.optimizer = optimizer(mine) if optimizer is not None and mine else None

    # ---- building ----------------------------------------------------------------------------------
    def _compile(self, args, kwargs, program: Program | None = None) -> _Compiled:
        flat, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        key = str(spec)
        if key in self._signatures:
            return self._signatures[key]
        mb = _split_batch(flat, self.batch, self.m)[0]
        on_meta = any(p.is_meta for p in self.model.parameters())
        if on_meta:  # a meta model is traced on meta inputs
            mb = [v.to("meta") if isinstance(v, torch.Tensor) else v for v in mb]
        mb_args, mb_kwargs = pytree.tree_unflatten(mb, spec)
        if program is None:
            program = trace(self.model, mb_args, mb_kwargs, frontend=self.frontend)
        elif program.root is not self.model or _traced_batch(program) != self.batch // self.m:
            raise PlanError(f"the program passed to compile must be fxpar.trace of this model on one microbatch "
                            f"({self.batch // self.m} of the batch of {self.batch}); it was traced on "
                            f"{_traced_batch(program)}")
        if self.cuts is None:
            if self.plan.split_points:
                self.cuts = resolve_split_points(program, self.plan.split_points)
                if len(self.cuts) != self.n_stages - 1:
                    raise PlanError(f"{len(self.cuts)} split points make {len(self.cuts) + 1} stages, but the plan "
                                    f"has pp={self.plan.pp} x {self.n_stages // self.plan.pp} stages per rank = "
                                    f"{self.n_stages}; give {self.n_stages - 1} split points")
            else:
                self.cuts = balanced_cuts(program, self.n_stages, self.device_model)
        full = program
        if self.tp > 1:
            styles = self.plan.tp_plan if isinstance(self.plan.tp_plan, dict) else None
            loss = loss_position(program)
            keep = None if loss is None else {[i for i, b in enumerate(program.outputs) if b.kind == "user"][loss]}
            program, self.tp_info = tensor_parallel(program, self.tp, self.tp_rank, styles, group="tp",
                                                    shards=self._tp_shards, keep_outputs=keep,
                                                    sequence_parallel=self.plan.sequence_parallel)
        pipeline = split_pipeline(program, self.cuts, self.stage_to_rank)
        if self.weights is not None:
            self._materialize(program, pipeline)
            if on_meta:
                _retarget_device([program.gm] + [s.gm for s in pipeline.stages], self.device)
        self._annotate_costs(full, pipeline)
        runtime = PipelineRuntime(pipeline, self.schedule, self.pp_rank, self.pp_ranks, None, self.device,
                                  self.timeout)
        compiled = _Compiled(program, pipeline, runtime)
        self._signatures[key] = compiled
        return compiled

    def _materialize(self, program: Program, pipeline: PipelineProgram) -> None:
        """Real tensors for the meta ones of this rank's stages, cut for its TP rank (fxpar.weights)."""
        for stage in pipeline.stages_of(self.pp_rank):
            for fqn in stage.params + stage.buffers:
                t = program.tensor(fqn)
                if not t.is_meta:
                    continue
                if fqn not in self._loaded:
                    v = self.weights.load(list(program.params[fqn].fqns), self.tp_info["sharded"].get(fqn),
                                          self.tp_info["pieces"].get(fqn), self.tp, self.tp_rank, like=t)
                    v = v.to(self.device)
                    self._loaded[fqn] = torch.nn.Parameter(v, requires_grad=t.requires_grad) \
                        if isinstance(t, torch.nn.Parameter) else v
                v = self._loaded[fqn]
                program.set_tensor(fqn, v)
                if fqn in self._tp_shards:
                    self._tp_shards[fqn] = v
                set_nested(stage.gm, fqn, v)
        self.weights.done()

    def _annotate_costs(self, program: Program, pipeline: PipelineProgram) -> None:
        """Predicted per-microbatch times and bytes on each stage, and the schedule's bubble."""
        units = cut_positions(program, candidate_modules(program))
        for spec, cost in zip(pipeline.stages, stage_costs(program, self.cuts, self.device_model)):
            spec.fwd_time, spec.bwd_time, spec.transfer_time = cost.fwd, cost.bwd, cost.transfer
            spec.modules = [m for pos, m in units.items() if cost.start <= pos < cost.end]
            spec.recv_bytes, spec.send_bytes = cost.recv_bytes, cost.send_bytes
        f = [s.fwd_time for s in pipeline.stages]
        b = [s.bwd_time for s in pipeline.stages]
        comm = max((self.device_model.transfer_time(s.send_bytes) for s in pipeline.stages), default=0.0)
        sim = sched.simulate(self.schedule, self.stage_to_rank,
                             {"F": f, "B": b, "I": [x / 2 for x in b], "W": [x / 2 for x in b]}, comm=comm)
        self.predicted = {"step_time": sim.makespan, "bubble": sim.bubble, "device": self.device_model.name}

    def _my_parameters(self, pipeline: PipelineProgram) -> list[torch.nn.Parameter]:
        seen, out = set(), []
        for stage in pipeline.stages_of(self.pp_rank):
            for p in stage.gm.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def _make_tied_groups(self, pipeline: PipelineProgram) -> list[tuple[str, list[int], object]]:
        """Process groups summing gradients of parameters held by stages on different ranks."""
        groups = []
        for fqn, stages in sorted(pipeline.tied.items()):
            ranks = sorted({self.stage_to_rank[s] for s in stages})
            if len(ranks) > 1:  # one group per TP rank, created by every rank in the same order
                mine = None
                for t in range(self.tp):
                    g = dist.new_group([r * self.tp + t for r in ranks])
                    mine = g if t == self.tp_rank else mine
                groups.append((fqn, ranks, mine))
        return groups

    # ---- running -----------------------------------------------------------------------------------
    def _microbatches(self, compiled: _Compiled, args, kwargs) -> list[list]:
        flat = compiled.program.flatten_inputs(tuple(args), dict(kwargs))
        batch = _batch_size(flat)
        if batch != self.batch:
            raise PlanError(f"batch of {batch} given, but the program was compiled for {self.batch} "
                            f"({self.m} microbatches of {self.batch // self.m}); compile again for this batch")
        return _split_batch([v.to(self.device) if isinstance(v, torch.Tensor) else v for v in flat],
                            batch, self.m)

    def step(self, *args, **kwargs) -> torch.Tensor:
        """Forward and backward over the microbatches, gradient sync, optimizer step; the batch's loss."""
        compiled = self._compile(args, kwargs)
        if compiled.pipeline.loss_output is None:
            raise PlanError("the model returned no loss for these inputs: pass labels (or whatever makes "
                            f"{type(self.model).__name__} compute its loss)")
        for p in self._my_parameters(compiled.pipeline):
            p.grad = None
        mbs = self._microbatches(compiled, args, kwargs)
        weights = _loss_weights(compiled.program, mbs, self.model)
        result = compiled.runtime.run(mbs, train=True, loss_weights=weights)
        for fqn, ranks, group in self._tied_groups:
            if self.pp_rank in ranks:
                p = compiled.program.tensor(fqn)
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad, group=group)
        loss_stage = next(s for s in compiled.pipeline.stages if compiled.pipeline.loss_output in s.final)
        loss = torch.zeros((), device=self.device)
        if result["losses"]:
            loss = sum(result["losses"][i].detach() for i in sorted(result["losses"])).to(self.device).reshape(())
        if self.world > 1:
            dist.broadcast(loss, src=loss_stage.rank * self.tp)  # TP rank 0 of the loss stage
        if self.optimizer is not None:
            self.optimizer.step()
        return loss

    @torch.no_grad()
    def __call__(self, *args, **kwargs):
        """Inference: forward over the microbatches; the model's outputs, gathered on every rank."""
        compiled = self._compile(args, kwargs)
        mbs = self._microbatches(compiled, args, kwargs)
        result = compiled.runtime.run(mbs, train=False)
        pipeline, program = compiled.pipeline, compiled.program
        outs = []
        for j in range(pipeline.num_user_outputs):
            stage = next((s for s in pipeline.stages if j in s.final), None)
            if stage is None:
                outs.append(None)
                continue
            val = stage.output_val(stage.final[j])
            if stage.rank == self.pp_rank:
                parts = [result["outputs"][i][j] for i in range(self.m)]
                full = torch.cat(parts) if val.dim() > 0 else sum(parts) / self.m
            else:
                shape = (val.shape[0] * self.m, *val.shape[1:]) if val.dim() > 0 else ()
                full = torch.empty(shape, dtype=val.dtype, device=self.device)
            if self.world > 1:
                dist.broadcast(full, src=stage.rank * self.tp)
            outs.append(full)
        return pytree.tree_unflatten(outs, program.out_spec)

    def full_state_dict(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """Full tensors keyed by the original FQNs (tied parameters under each name), on every rank.
        ``grads=True``: the parameters' gradients from the last ``step`` instead (zeros where none).

        TP shards are gathered within the owning stage's TP group, then sent from its TP rank 0.
        """
        pipeline, program = self.train.pipeline, self.train.program
        owner: dict[str, int] = {}
        for stage in pipeline.stages:
            for fqn in stage.params + stage.buffers:
                owner.setdefault(fqn, stage.rank)
        out = {}
        named = dict(self.model.named_parameters(remove_duplicate=False)) if grads else \
            self.model.state_dict(keep_vars=True)
        for name, value in named.items():
            try:
                fqn = program.canonical(name)
            except KeyError:  # a tensor the traced graph does not bind
                fqn = name
            local = program.tensor(fqn) if fqn in program.params else value
            if grads:
                local = local.grad if local.grad is not None else torch.zeros_like(local)
            d = self.tp_info["sharded"].get(fqn)
            shape = list(local.shape)
            if d is not None:
                shape[d] *= self.tp
            mine = owner.get(fqn, self.pp_rank) == self.pp_rank
            if d is not None and mine:
                parts = [torch.empty_like(local) for _ in range(self.tp)]
                dist.all_gather(parts, local.detach().contiguous(), group=fxops.resolve_group("tp"))
                full = unshard(parts, d, self.tp_info["pieces"].get(fqn))
            else:
                full = local.detach().clone() if mine else torch.empty(shape, dtype=local.dtype, device=self.device)
            if self.world > 1 and fqn in owner:
                dist.broadcast(full, src=owner[fqn] * self.tp)
            out[name] = full
        return out

    # ---- reading -----------------------------------------------------------------------------------
    def stage_costs(self) -> list[StageCost]:
        return stage_costs(self.train.program, self.cuts, self.device_model)

    @property
    def pipeline(self) -> PipelineProgram:
        return self.train.pipeline

    @property
    def program(self) -> Program:
        return self.train.program


def compile(model: torch.nn.Module, plan: Plan | str, example_args: tuple = (), example_kwargs: dict | None = None,
            *, optimizer=None, device=None, device_model: DeviceModel = H100, frontend: str = "auto",
            timeout: float | None = None, program: Program | None = None, weights=None) -> CompiledModel:
    """Compile ``model`` for ``plan`` on this rank (call it on every rank with the same arguments).

    ``example_kwargs`` is one full batch (labels included for training); ``optimizer`` a factory
    ``params -> torch.optim.Optimizer`` applied to the parameters this rank holds. ``timeout``: seconds a
    rank waits for a peer before failing with a message that names it (default 300, or
    ``FXPAR_TIMEOUT``). ``program``: an ``fxpar.trace`` of ``model`` on one microbatch, to compile one
    trace for several plans without tracing again. ``weights``: for a model built on the meta device,
    where each rank's shards come from: a state dict with the model's FQNs, safetensors path(s), or
    ``"init"`` (the model's initialiser); see :mod:`fxpar.weights`.
    """
    if isinstance(plan, str):
        plan = Plan.parse(plan)
    timeout = float(timeout if timeout is not None else os.environ.get("FXPAR_TIMEOUT", 300))
    return CompiledModel(model, plan, example_args, dict(example_kwargs or {}), optimizer, device=device,
                         device_model=device_model, frontend=frontend, timeout=timeout, program=program,
                         weights=weights)
