"""Run pipeline stages over microbatches, following a schedule's per-rank list of compute actions.

Each rank executes its actions in order: ``F`` (forward of one stage on one microbatch), ``B`` (its
full backward), or the zero-bubble split ``I`` (gradients of the stage's inputs) and ``W`` (of its
weights, later). Values go straight from the stage that produces them to every stage that reads them
(the routing table of :class:`~fxpar.ir.stage.PipelineProgram`), and gradients straight back.

Why not torch.distributed.pipelining's ``PipelineStage`` and schedule executors: they move one
argument tuple from stage i to stage i+1 only, so a value read several stages later (masks, rotary
tables, a residual) would have to be relayed through every stage between, and each stage must have
a fixed positional interface. The schedules' action orders are reused (``fxpar.ir.schedule``),
and so are torch's split-backward helpers for the zero-bubble ``I``/``W`` actions.

Transport: every rank can compute every other rank's send order from the schedule, so receives are
posted in exactly the order the sender sends. That matching rule works for NCCL (which ignores tags)
as for gloo. Sends are asynchronous; a rank blocks only when it needs a value, with a timeout that
names the value and the rank it waited for. The transfers are the ``send`` pattern's wire
(:mod:`fxpar.runtime.dist_calls`).

Python scalars and symbolic sizes: a stage may hand a later one a Python int the trace could not know (``u0``
from an ``.item()`` whose cone reads a parameter, so the reader cannot make it again; an int the trace knew is
baked into the reader by :mod:`fxpar.passes.pipeline_split`), and tensors sized by it. The wire moves tensors of
a size both ends know, so such a scalar (a ``SymInt``, ``SymFloat`` or ``SymBool`` ``val``) travels as a 0-d
tensor and is a Python scalar again on arrival, and a tensor whose ``val`` shape holds a symbol is preceded by
its shape (a 1-D int64 message), which the receiver waits for before it sizes the buffer. Both ends read the
same ``val``, so they agree on which messages carry a shape.
"""

from __future__ import annotations

import contextlib
import datetime
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from fxpar.ir.errors import CollectiveError, PipelineError
from fxpar.ir.schedule import Action
from fxpar.ir.stage import PipelineProgram, StageSpec
from fxpar.runtime import dist_calls

_SCALAR_WIRE = {int: torch.int64, float: torch.float64, bool: torch.int64}  # what each scalar travels as


def _scalar_kind(val) -> type:
    """The Python type a non-tensor stage output carries (its ``val``: a ``SymInt``, ``SymFloat``, ``SymBool``)."""
    for sym, kind in ((torch.SymBool, bool), (torch.SymInt, int), (torch.SymFloat, float), (bool, bool),
                      (int, int), (float, float)):
        if isinstance(val, sym):
            return kind
    raise PipelineError(f"a pipeline stage output of type {type(val).__name__} ({val!r}) cannot cross a stage "
                        "boundary: only tensors and Python scalars can")


def _static_shape(val: torch.Tensor) -> bool:
    return all(isinstance(d, int) for d in val.shape)


def _detached(value):
    return value.detach() if isinstance(value, torch.Tensor) else value


@dataclass(frozen=True)
class _Msg:
    kind: str  # "act" | "grad"
    stage: int  # producing stage of the value
    index: int  # its output index there
    mb: int
    consumer: int = -1  # for grads: the consuming stage that sends it


def send_order(pprog: PipelineProgram, actions: list[Action]) -> list[tuple[int, _Msg]]:
    """(destination pp rank, message) in the order a rank running ``actions`` sends them."""
    rank_of = pprog.stage_to_rank
    sends = []
    for act in actions:
        spec = pprog.stages[act.stage]
        me = rank_of[act.stage]
        if act.kind == "F":
            for i, cons in enumerate(spec.consumers):
                for dst in sorted({rank_of[c] for c in cons} - {me}):
                    sends.append((dst, _Msg("act", act.stage, i, act.mb)))
        elif act.kind in ("B", "I"):
            for ref, grad in zip(spec.inputs, spec.input_needs_grad):
                if grad and not ref.is_user and rank_of[ref.stage] != me:
                    sends.append((rank_of[ref.stage], _Msg("grad", ref.stage, ref.index, act.mb, act.stage)))
    return sends


class Transport:
    """Ordered point-to-point messages between the ranks of one pipeline group."""

    def __init__(self, pprog: PipelineProgram, schedule: dict[int, list[Action]], me: int,
                 global_ranks: list[int], group, device: torch.device, timeout: float):
        self.pprog, self.me, self.ranks, self.group = pprog, me, global_ranks, group
        self.device, self.timeout = device, datetime.timedelta(seconds=timeout)
        # what each other rank will send me, in its order
        self.expected: dict[int, list[_Msg]] = {
            src: [m for dst, m in send_order(pprog, acts) if dst == me]
            for src, acts in schedule.items() if src != me}
        self.posted: dict[int, int] = defaultdict(int)
        self.inbox: dict[_Msg, tuple[torch.Tensor, object]] = {}
        self.pending_sends: list = []

    def _val(self, msg: _Msg):
        return self.pprog.stages[msg.stage].output_val(msg.index)

    def send(self, value, dst: int, msg: _Msg) -> None:
        """``value`` (a tensor, or a Python scalar where the producer's ``val`` is symbolic) to pipeline rank
        ``dst``; a tensor of a symbolic shape after its shape."""
        val = self._val(msg)
        if not isinstance(val, torch.Tensor):
            value = torch.tensor(value, dtype=_SCALAR_WIRE[_scalar_kind(val)], device=self.device)
        elif not _static_shape(val):
            self._post_send(torch.tensor(value.shape, dtype=torch.int64, device=self.device), dst)
        self._post_send(value.detach().contiguous(), dst)

    def _post_send(self, tensor: torch.Tensor, dst: int) -> None:
        self.pending_sends.append((dist_calls.send(tensor, self.ranks[dst], self.group, async_op=True), tensor))

    def _post_recv(self, shape, dtype, src: int):
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        return buf, dist_calls.recv(buf, self.ranks[src], self.group, async_op=True)

    def recv(self, msg: _Msg, src: int):
        """The message ``msg`` from pipeline rank ``src``: a tensor, or the Python scalar it carries."""
        queue = self.expected.get(src, [])
        while msg not in self.inbox:
            k = self.posted[src]
            if k >= len(queue):
                raise PipelineError(f"rank {self.me} waits for {msg} from pipeline rank {src}, which never sends it "
                                    "(schedule and routing disagree)")
            m = queue[k]
            val = self._val(m)
            if not isinstance(val, torch.Tensor):
                self.inbox[m] = self._post_recv((), _SCALAR_WIRE[_scalar_kind(val)], src)
            elif _static_shape(val):
                self.inbox[m] = self._post_recv(val.shape, val.dtype, src)
            else:  # its shape first: the receives from one rank are matched in the order they are posted
                shape, work = self._post_recv((val.dim(),), torch.int64, src)
                self._wait(work, m, src)
                self.inbox[m] = self._post_recv(shape.tolist(), val.dtype, src)
            self.posted[src] = k + 1
        buf, work = self.inbox.pop(msg)
        self._wait(work, msg, src)
        val = self._val(msg)
        return buf if isinstance(val, torch.Tensor) else _scalar_kind(val)(buf.item())

    def _wait(self, work, msg: _Msg, src: int) -> None:
        try:
            work.wait(self.timeout)
        except Exception as error:
            # the backend's own error, not the wire's wrapping of it: this message names what it waited for
            exc = error.__cause__ if isinstance(error, CollectiveError) and error.__cause__ else error
            raise PipelineError(
                f"pipeline rank {self.me} (global {self.ranks[self.me]}) failed (or timed out: limit "
                f"{self.timeout.total_seconds():.0f} s) waiting for {msg.kind} of stage {msg.stage} output "
                f"{msg.index}, microbatch {msg.mb}, from pipeline rank {src} (global {self.ranks[src]}): "
                f"that rank died or is stuck ({type(exc).__name__}: {exc})") from exc

    def finish(self) -> None:
        for work, _ in self.pending_sends:
            work.wait(self.timeout)
        self.pending_sends.clear()
        if self.inbox:
            raise PipelineError(f"rank {self.me}: messages received but never used: {list(self.inbox)[:4]}")


@dataclass
class StepOutputs:
    """What one rank's run of a schedule produced."""

    losses: dict[int, torch.Tensor]  # microbatch -> its weighted loss, where this rank computes the loss
    outputs: dict[int, dict[int, torch.Tensor]]  # microbatch -> {user output position: tensor} of its stages


class PipelineRuntime:
    """Executes one rank's share of a :class:`PipelineProgram` for one step."""

    def __init__(self, pprog: PipelineProgram, schedule: dict[int, list[Action]], me: int,
                 global_ranks: list[int], group=None, device: torch.device | str = "cpu", timeout: float = 300.0,
                 *, forward_context=None, autocast_dtype: torch.dtype | None = None, stage_fns=None):
        self.pprog, self.schedule, self.me = pprog, schedule, me
        self.actions = schedule[me]
        self.rank_of = pprog.stage_to_rank
        self.device = torch.device(device)
        self.global_ranks, self.group, self.timeout = global_ranks, group, timeout
        self.stages = {s.index: s for s in pprog.stages_of(me)}
        # wraps each training forward (ZeRO-3's regathering), told whether its backward comes next
        self.forward_context = forward_context
        self.autocast_dtype = autocast_dtype  # mixed precision: forwards run under torch.autocast
        self.stage_fns = stage_fns or {}  # stage -> what runs it instead of its GraphModule (compiled)
        # (stage, output) -> how many stages on this rank read it
        self.local_readers: dict[tuple[int, int], int] = defaultdict(int)
        for s in self.stages.values():
            for ref in s.inputs:
                if not ref.is_user:
                    self.local_readers[ref.stage, ref.index] += 1

    def weights(self, stage: StageSpec) -> list[torch.nn.Parameter]:
        return [p for p in stage.gm.parameters() if p.requires_grad]

    def run(self, microbatches: list[list], *, train: bool, loss_weights: list[float] | None = None) -> StepOutputs:
        """Run the schedule (``train``) or its forward actions only. Returns, for this rank:
        ``losses`` {mb: weighted loss} where the loss is computed, ``outputs`` {mb: {user output: tensor}}."""
        transport = Transport(self.pprog, self.schedule if train else self._forward_only(), self.me,
                              self.global_ranks, self.group, self.device, self.timeout)
        acts: dict[tuple[int, int, int], torch.Tensor] = {}  # (stage, out, mb) -> value, until read
        left: dict[tuple[int, int, int], int] = {}  # local stages yet to read it
        grads: dict[tuple[int, int, int], list[torch.Tensor]] = defaultdict(list)
        saved: dict[tuple[int, int], tuple] = {}
        pending_w: dict[tuple[int, int], list] = {}
        losses: dict[int, torch.Tensor] = {}
        outputs: dict[int, dict[int, torch.Tensor]] = defaultdict(dict)
        loss_pos = self.pprog.loss_output
        actions = self.actions if train else [a for a in self.actions if a.kind == "F"]

        for step, act in enumerate(actions):
            spec = self.stages[act.stage]
            key = (act.stage, act.mb)
            if act.kind == "F":
                args = []
                for ref, need in zip(spec.inputs, spec.input_needs_grad):
                    if ref.is_user:
                        v = microbatches[act.mb][ref.index]
                    else:
                        k = (ref.stage, ref.index, act.mb)
                        if k not in acts:  # sent once per rank, however many of its stages read it
                            acts[k] = transport.recv(_Msg("act", *k), self.rank_of[ref.stage])
                        v = acts[k]
                        left[k] = left.get(k, self.local_readers[ref.stage, ref.index]) - 1
                        if left[k] == 0:
                            del acts[k], left[k]
                    if need and train:
                        v = v.detach().requires_grad_(True)
                    args.append(v)
                context = contextlib.nullcontext()
                if train and self.forward_context is not None:
                    nxt = actions[step + 1] if step + 1 < len(actions) else None
                    context = self.forward_context(backward_next=nxt is not None and nxt.kind in ("B", "I")
                                                   and (nxt.stage, nxt.mb) == (act.stage, act.mb))
                with torch.set_grad_enabled(train), context, \
                        (torch.autocast(self.device.type, dtype=self.autocast_dtype) if self.autocast_dtype
                         else contextlib.nullcontext()):
                    outs = self.stage_fns.get(act.stage, spec.gm)(*args)
                for i, (o, cons) in enumerate(zip(outs, spec.consumers)):
                    for dst in sorted({self.rank_of[c] for c in cons}):
                        if dst == self.me:
                            acts[(act.stage, i, act.mb)] = _detached(o)
                        else:
                            transport.send(o, dst, _Msg("act", act.stage, i, act.mb))
                for j, i in spec.final.items():
                    outputs[act.mb][j] = _detached(outs[i])
                if train:
                    saved[key] = (args, outs)
                    if loss_pos is not None and loss_pos in spec.final:
                        losses[act.mb] = outs[spec.final[loss_pos]] * loss_weights[act.mb]
            elif act.kind in ("B", "I"):
                args, outs = saved.pop(key)
                tensors, out_grads = [], []
                for i, (o, need) in enumerate(zip(outs, spec.output_needs_grad)):
                    if not need:
                        continue
                    g = None
                    for c in spec.consumers[i]:
                        if self.rank_of[c] == self.me:
                            parts = grads.pop((act.stage, i, act.mb, c), [])
                            part = parts[0] if parts else None
                        else:
                            part = transport.recv(_Msg("grad", act.stage, i, act.mb, c), self.rank_of[c])
                        if part is not None:
                            g = part if g is None else g + part
                    if loss_pos is not None and spec.final.get(loss_pos) == i:
                        lw = torch.full_like(o, loss_weights[act.mb])
                        g = lw if g is None else g + lw
                    if g is not None:
                        # torch's split backward detaches its roots in place, which views refuse
                        tensors.append(o.clone() if act.kind == "I" and o._is_view() else o)
                        out_grads.append(g)
                inputs_needing = [a for a, need in zip(args, spec.input_needs_grad) if need]
                if act.kind == "B" or not inputs_needing or act.stage in self.stage_fns:
                    # a stage whose inputs need no gradient (the first) has nothing to split: its whole
                    # backward is weight gradients, done here, and its W does nothing; nor has a compiled
                    # stage, whose backward is one autograd node
                    if tensors:
                        torch.autograd.backward(tensors, out_grads)
                    in_grads = [a.grad for a in inputs_needing]
                    if act.kind == "I":
                        pending_w[key] = None
                else:
                    in_grads, groups = stage_backward_input(tensors, out_grads, inputs_needing,
                                                            iter(self.weights(spec)))
                    pending_w[key] = groups
                it = iter(in_grads)
                for ref, need, a in zip(spec.inputs, spec.input_needs_grad, args):
                    if not need:
                        continue
                    g = next(it)
                    if g is None:
                        g = torch.zeros_like(a)
                    if self.rank_of[ref.stage] == self.me:
                        grads[(ref.stage, ref.index, act.mb, act.stage)].append(g.detach())
                    else:
                        msg = _Msg("grad", ref.stage, ref.index, act.mb, act.stage)
                        transport.send(g, self.rank_of[ref.stage], msg)
            elif act.kind == "W":
                groups = pending_w.pop(key)
                if groups is not None:
                    stage_backward_weight(iter(self.weights(spec)), groups)
                    missing = [n for n, p in spec.gm.named_parameters() if p.requires_grad and p.grad is None]
                    if missing:
                        raise PipelineError(
                            f"stage {spec.index}: the split backward left {missing[:4]} without gradients (their "
                            "gradient path does not meet the stage inputs); use a schedule without I/W split")
            else:
                raise PipelineError(f"unknown action kind {act.kind!r}")
        transport.finish()
        if saved or pending_w:
            raise PipelineError(f"rank {self.me}: schedule left work undone: {list(saved)[:4]} {list(pending_w)[:4]}")
        return StepOutputs(losses, dict(outputs))

    def _forward_only(self) -> dict[int, list[Action]]:
        return {r: [a for a in acts if a.kind == "F"] for r, acts in self.schedule.items()}
