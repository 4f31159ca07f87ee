"""``fxpar.compile``: trace, plan, split and run a model as a distributed program on every rank.

Every rank calls ``compile`` with the same model (or a meta-device one with the same structure), the
same plan and example inputs, and then ``step``/``__call__`` with the same full (global) batch: each
data-parallel replica takes its slice, and only the stages a rank runs read it (the first stage its
input ids, the last its labels), so no input travels.

Order of work in ``compile``: validate the plan against the world, the batch and the optimizer, and
build the schedule, all before any communication; then the device mesh ``(dp, pp, tp)`` and its groups;
trace one microbatch; tensor-parallel pass; cuts and pipeline split; weights for meta models; ZeRO-3
pass; then process groups for parameters shared between stages on different ranks, and the
data-parallel engine.
"""

from __future__ import annotations

import os
import warnings
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
from fxpar.passes.zero import zero3
from fxpar.runtime import ops as fxops
from fxpar.runtime import schedules as sched
from fxpar.runtime.data_parallel import DataParallelEngine, check_optimizer, regather_for_backward
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


def _drop_dtype_asserts(gm: torch.fx.GraphModule) -> None:
    """Remove export's ``_assert_tensor_metadata`` checks (dtypes seen at trace time): under autocast
    the same values are bf16. They compute nothing."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten._assert_tensor_metadata.default:
            gm.graph.erase_node(node)
    gm.recompile()


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
        if (plan.dp > 1 or plan.zero) and optimizer is None:
            raise PlanError("data parallelism and ZeRO need the optimizer: pass optimizer=lambda params: ...")
        if plan.zero and optimizer is not None:  # refuse an optimizer ZeRO cannot shard before any work
            check_optimizer(optimizer([torch.nn.Parameter(torch.zeros(1))]), plan.zero)
        if plan.zero >= 2 and plan.pp > 1:
            cost = ("gathers every parameter bucket again for each microbatch's forward and backward" if plan.zero == 3
                    else "holds full gradients while the microbatches accumulate (its saving starts after the last)")
            warnings.warn(f"ZeRO-{plan.zero} with pipeline parallelism {cost}; ZeRO-1 is the usual choice with "
                          "pp > 1", stacklevel=3)
        # ranks: TP innermost, then PP, then DP: rank = (dp_rank * pp + pp_rank) * tp + tp_rank
        self.tp, self.dp = plan.tp, plan.dp
        self.tp_rank, self.pp_rank = self.rank % plan.tp, (self.rank // plan.tp) % plan.pp
        self.dp_rank = self.rank // (plan.tp * plan.pp)
        self.replica = self.dp_rank * plan.pp * plan.tp  # first global rank of my data-parallel replica
        self.pp_ranks = [self.replica + p * plan.tp + self.tp_rank for p in range(plan.pp)]  # my pipeline
        self.tp_info: dict = {"sharded": {}, "pieces": {}}
        self._tp_shards: dict[str, torch.Tensor] = {}  # this rank's TP shards, shared by every signature
        self.schedule_name = sched.normalize_schedule(plan.schedule)
        v = sched.stages_per_rank(self.schedule_name, plan.virtual_stages)
        self.n_stages = plan.pp * v
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        flat, _ = pytree.tree_flatten((tuple(example_args), dict(example_kwargs)))
        self.batch = _batch_size(flat)
        self.m = plan.microbatches or self.n_stages
        if self.batch % (self.m * plan.dp):
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
        # the only collectives before tracing: the device mesh and its groups, made by every rank
        self.mesh = None
        self.dp_axis = "dp_shard" if plan.zero else "dp_replicate"
        if self.world > 1:
            from torch.distributed.device_mesh import init_device_mesh

            self.mesh = init_device_mesh(self.device.type, (plan.dp, plan.pp, plan.tp),
                                         mesh_dim_names=(self.dp_axis, "pp", "tp"))
            fxops.register_group("tp", self.mesh.get_group("tp"))
            fxops.register_group("dp", self.mesh.get_group(self.dp_axis))
        elif plan.zero:
            fxops.register_group("dp", size=1)
        self._zero3_cache: dict = {}
        self._zero3_buckets: dict[int, list] = {}  # stage -> its ZeRO-3 buckets (training signature)
        self.train = self._compile(example_args, example_kwargs, program)
        self._tied_groups = self._make_tied_groups(self.train.pipeline)
        mine = self._my_parameters(self.train.pipeline)
        # a rank whose stages hold no parameter (possible with tiny models) has nothing to optimise
        self.engine = None
        if plan.zero == 3 and self._tied_groups:
            raise PlanError(f"ZeRO-3 shards each stage's parameters on their own, so weights tied across pipeline "
                            f"ranks ({[g[0] for g in self._tied_groups]}) would drift apart; use zero=1 or 2 with "
                            "this plan, or place the tied layers on one pipeline rank")
        if plan.dp > 1 or plan.zero:
            self.engine = DataParallelEngine(self._my_named_parameters(self.train.pipeline), optimizer, dp=plan.dp, rank=self.dp_rank, zero=plan.zero,
                                             bucket_bytes=int((plan.bucket_mb or 25) * 2**20),
                                             overlap=not self._tied_groups, offload=plan.offload)
            self.optimizer = self.engine.optimizer
        else:
            self.optimizer = optimizer(mine) if optimizer is not None and mine else None

    # ---- building ----------------------------------------------------------------------------------
    def _compile(self, args, kwargs, program: Program | None = None) -> _Compiled:
        flat, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        key = str(spec)
        if key in self._signatures:
            return self._signatures[key]
        mb = _split_batch(flat, self.batch, self.m * self.dp)[0]
        on_meta = any(p.is_meta for p in self.model.parameters())
        if on_meta:  # a meta model is traced on meta inputs
            mb = [v.to("meta") if isinstance(v, torch.Tensor) else v for v in mb]
        mb_args, mb_kwargs = pytree.tree_unflatten(mb, spec)
        if program is None:
            program = trace(self.model, mb_args, mb_kwargs, frontend=self.frontend)
        elif program.root is not self.model or _traced_batch(program) != self.batch // (self.m * self.dp):
            raise PlanError(f"the program passed to compile must be fxpar.trace of this model on one microbatch "
                            f"({self.batch // (self.m * self.dp)} of the batch of {self.batch}: {self.m} microbatches "
                            f"x dp={self.dp}); it was traced on {_traced_batch(program)}")
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
        if self.plan.zero == 3:
            for stage in pipeline.stages_of(self.pp_rank):
                buckets = zero3(stage.gm, stage.params, self.dp, self.dp_rank, group="dp",
                                bucket_bytes=int((self.plan.bucket_mb or 0) * 2**20),
                                prefetch=self.plan.prefetch, cache=self._zero3_cache,
                                compute_dtype=torch.bfloat16 if self.plan.mixed_precision == "bf16" else None)
                self._zero3_buckets.setdefault(stage.index, buckets)
        runtime = PipelineRuntime(pipeline, self.schedule, self.pp_rank, self.pp_ranks, None, self.device,
                                  self.timeout)
        if self.plan.zero == 3:
            runtime.forward_context = regather_for_backward
        if self.plan.mixed_precision == "bf16":
            runtime.autocast_dtype = torch.bfloat16
            for stage in pipeline.stages_of(self.pp_rank):  # the trace asserted fp32 where autocast gives bf16
                _drop_dtype_asserts(stage.gm)
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

    def _my_named_parameters(self, pipeline: PipelineProgram) -> list[tuple[str, torch.nn.Parameter]]:
        """(name in its stage, parameter) for the stages this rank runs, each parameter once."""
        seen, out = set(), []
        for stage in pipeline.stages_of(self.pp_rank):
            for n, p in stage.gm.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append((n, p))
        return out

    def _my_parameters(self, pipeline: PipelineProgram) -> list[torch.nn.Parameter]:
        return [p for _, p in self._my_named_parameters(pipeline)]

    def _make_tied_groups(self, pipeline: PipelineProgram) -> list[tuple[str, list[int], object]]:
        """Process groups summing gradients of parameters held by stages on different ranks."""
        groups = []
        for fqn, stages in sorted(pipeline.tied.items()):
            ranks = sorted({self.stage_to_rank[s] for s in stages})
            if len(ranks) > 1:  # one group per (DP replica, TP rank), made by every rank in the same order
                mine = None
                stride = self.plan.pp * self.tp
                for d in range(self.dp):
                    for t in range(self.tp):
                        g = dist.new_group([d * stride + r * self.tp + t for r in ranks])
                        mine = g if (d, t) == (self.dp_rank, self.tp_rank) else mine
                groups.append((fqn, ranks, mine))
        return groups

    # ---- running -----------------------------------------------------------------------------------
    def _microbatches(self, compiled: _Compiled, args, kwargs) -> list[list]:
        """Every data-parallel rank's microbatches of the global batch, dp rank-major (rank d owns
        ``[d * m, (d + 1) * m)``)."""
        flat = compiled.program.flatten_inputs(tuple(args), dict(kwargs))
        batch = _batch_size(flat)
        if batch != self.batch:
            raise PlanError(f"batch of {batch} given, but the program was compiled for {self.batch} "
                            f"({self.dp} x {self.m} microbatches of {self.batch // (self.dp * self.m)}); compile "
                            "again for this batch")
        return _split_batch([v.to(self.device) if isinstance(v, torch.Tensor) else v for v in flat],
                            batch, self.dp * self.m)

    def _mine(self, mbs: list) -> list:
        return mbs[self.dp_rank * self.m:(self.dp_rank + 1) * self.m]

    def step(self, *args, **kwargs) -> torch.Tensor:
        """Forward and backward over the microbatches, gradient sync, optimizer step; the batch's loss."""
        compiled = self._compile(args, kwargs)
        if compiled.pipeline.loss_output is None:
            raise PlanError("the model returned no loss for these inputs: pass labels (or whatever makes "
                            f"{type(self.model).__name__} compute its loss)")
        for p in self._my_parameters(compiled.pipeline):
            p.grad = None
        if self.engine is not None:
            self.engine.start_step()
        every = self._microbatches(compiled, args, kwargs)
        weights = self._mine(_loss_weights(compiled.program, every, self.model))  # shares of the global batch
        result = compiled.runtime.run(self._mine(every), train=True, loss_weights=weights)
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
        if self.world > 1:  # the loss stage's TP rank 0 of every replica holds its share of the global loss
            if not (loss_stage.rank == self.pp_rank and self.tp_rank == 0):
                loss.zero_()
            dist.all_reduce(loss)
        if self.engine is not None:
            self.engine.step()
        elif self.optimizer is not None:
            self.optimizer.step()
        return loss

    @torch.no_grad()
    def __call__(self, *args, **kwargs):
        """Inference: forward over the microbatches; the model's outputs, gathered on every rank."""
        compiled = self._compile(args, kwargs)
        every = self._microbatches(compiled, args, kwargs)
        mbs = [every[i * self.m:(i + 1) * self.m] for i in range(self.dp)]
        # each replica runs its slice; outputs are exchanged below (every rank gets the whole batch)
        result = compiled.runtime.run(mbs[self.dp_rank], train=False)
        pipeline, program = compiled.pipeline, compiled.program
        outs = []
        for j in range(pipeline.num_user_outputs):
            stage = next((s for s in pipeline.stages if j in s.final), None)
            if stage is None:
                outs.append(None)
                continue
            val = stage.output_val(stage.final[j])
            # every replica's slice written in place by its owner (the stage's TP rank 0), then summed
            shape = (val.shape[0] * self.m * self.dp, *val.shape[1:]) if val.dim() > 0 else ()
            full = torch.zeros(shape, dtype=val.dtype, device=self.device)
            if stage.rank == self.pp_rank and self.tp_rank == 0:
                parts = [result["outputs"][i][j] for i in range(self.m)]
                if val.dim() > 0:
                    n = val.shape[0] * self.m
                    full[self.dp_rank * n:(self.dp_rank + 1) * n] = torch.cat(parts)
                else:
                    full = (sum(parts) / (self.m * self.dp)).to(val.dtype)
            if self.world > 1:
                dist.all_reduce(full)
            outs.append(full)
        return pytree.tree_unflatten(outs, program.out_spec)

    def full_state_dict(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """Full tensors keyed by the original FQNs (tied parameters under each name), on every rank.
        ``grads=True``: the parameters' gradients from the last ``step`` instead (zeros where none).

        TP shards are gathered within the owning stage's TP group, then sent from its TP rank 0.
        """
        pipeline, program = self.train.pipeline, self.train.program
        if self.plan.zero == 3:
            self._sync_zero3(grads)
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

    def _sync_zero3(self, grads: bool) -> None:
        """Gather every ZeRO-3 bucket of this rank's stages into the original parameters (or their
        gradients), so the full state can be read under the original FQNs."""
        pg = fxops.resolve_group("dp")
        program = self.train.program
        for buckets in self._zero3_buckets.values():
            for b in buckets:
                src = b.shard.grad if grads else b.shard.detach()
                if src is None:
                    src = torch.zeros_like(b.shard)
                full = torch.empty(b.shard_numel * self.dp, dtype=src.dtype, device=src.device)
                fxops.all_gather_single(full, src.contiguous(), group=pg)
                for name, piece in b.unflatten(full).items():
                    p = program.tensor(name)
                    if grads:
                        p.grad = piece.clone()
                    else:
                        with torch.no_grad():
                            p.copy_(piece)

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds now for parameters, gradients and optimizer states: measured from the
        tensors, and predicted from parameter counts (fp32 master weights; Adam-style optimizers keep
        two states, SGD with momentum one)."""
        if self.engine is not None:
            measured = self.engine.memory()
        else:
            params = self._my_parameters(self.train.pipeline)
            states = [v for st in (self.optimizer.state.values() if self.optimizer else []) for v in st.values()
                      if isinstance(v, torch.Tensor) and v.dim() > 0]
            measured = {"params": sum(p.numel() * p.element_size() for p in params),
                        "grads": sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None),
                        "optimizer": sum(t.numel() * t.element_size() for t in states)}
        n = sum(p.numel() for s in self.train.pipeline.stages_of(self.pp_rank)
                for p in {id(q): q for q in self._stage_tensors(s)}.values())
        opt = self.optimizer
        states = 2 if isinstance(opt, (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
                                       torch.optim.RAdam)) else \
            1 if opt is not None and any(g.get("momentum", 0) for g in opt.param_groups) else 0
        z, dp = self.plan.zero, self.dp
        predicted = {"params": 4 * n // dp if z == 3 else 4 * n + (4 * n // dp if z in (1, 2) else 0),  # + fp32 shard
                     "grads": 4 * n // dp if z >= 2 else 4 * n + (4 * n // dp if z == 1 else 0),
                     "optimizer": 4 * states * n // (dp if z >= 1 else 1)}
        return {"measured": measured, "predicted": predicted}

    def _stage_tensors(self, stage) -> list[torch.Tensor]:
        """The trainable parameters a stage computes with, whole (before any ZeRO-3 sharding)."""
        program = self.train.program
        return [program.tensor(f) for f in stage.params if program.tensor(f).requires_grad]

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
