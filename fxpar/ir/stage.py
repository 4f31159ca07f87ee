"""Pipeline stages: what the split pass produces and the pipeline runtime executes.

A stage is a ``GraphModule`` whose parameters keep their original FQNs (``get_attr`` nodes named
``model.layers.3.mlp.up_proj.weight``) plus a routing table: where each of its inputs comes from (a
user input, given to every rank, or an output of an earlier stage, sent straight from the stage that
produced it) and which later stages read each of its outputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx

from fxpar.ir.numeric import nbytes


@dataclass(frozen=True)
class ValueRef:
    """A stage input: user input ``index`` (flattened call arguments), or output ``index`` of ``stage``."""

    stage: int | None  # None: a user input
    index: int

    @property
    def is_user(self) -> bool:
        return self.stage is None


@dataclass
class StageSpec:
    index: int
    rank: int
    first_module: str  # the cut this stage starts at ("" for stage 0)
    gm: torch.fx.GraphModule
    inputs: list[ValueRef]
    input_needs_grad: list[bool]
    outputs: list[str]  # names of the nodes this stage returns (graph order)
    output_needs_grad: list[bool]
    consumers: list[list[int]]  # per output: the later stages that read it
    final: dict[int, int] = field(default_factory=dict)  # program user-output position -> output index
    params: list[str] = field(default_factory=list)  # canonical FQNs of parameters it holds
    buffers: list[str] = field(default_factory=list)
    fwd_time: float = 0.0  # predicted seconds per microbatch (cost model)
    bwd_time: float = 0.0
    transfer_time: float = 0.0  # predicted seconds of its sends and receives, gradients included
    recv_bytes: int = 0  # predicted activation bytes received per microbatch (cost model)
    send_bytes: int = 0  # predicted bytes sent per microbatch: each output once to each stage reading it
    modules: list[str] = field(default_factory=list)  # top-level units it runs, for reading

    def output_nodes(self) -> list[torch.fx.Node]:
        """The nodes the stage returns, in output order."""
        return list(next(n for n in self.gm.graph.nodes if n.op == "output").args[0])

    def output_val(self, index: int):
        """The FakeTensor (``val``) of output ``index``: its local shape and dtype."""
        return self.output_nodes()[index].meta["val"]

    def sends(self) -> list[tuple[str, int, list[int]]]:
        """What the stage sends per microbatch, read from its routing table: (output name, bytes, the
        later stages it goes to) for each output a later stage reads."""
        return [(node.name, _bytes(node.meta.get("val")), cons)
                for node, cons in zip(self.output_nodes(), self.consumers) if cons]


def _bytes(val) -> int:
    if isinstance(val, (tuple, list)):
        return sum(_bytes(v) for v in val)
    return nbytes(val, missing=1) or 0


@dataclass
class PipelineProgram:
    """All stages of one traced program, identical on every rank."""

    stages: list[StageSpec]
    stage_to_rank: list[int]
    num_user_inputs: int
    num_user_outputs: int
    loss_output: int | None  # position of the loss among the program's user outputs
    tied: dict[str, list[int]]  # canonical FQN -> stages holding it, for parameters held by several
    cuts: list[tuple[str, str]]  # (module, "beginning" | "end") where each stage after the first starts

    def stages_of(self, rank: int) -> list[StageSpec]:
        return [s for s in self.stages if s.rank == rank]

    def links(self) -> dict[tuple[int, int], int]:
        """(from stage, to stage) -> bytes sent forward per microbatch, read from the routing tables."""
        out: dict[tuple[int, int], int] = {}
        for s in self.stages:
            for _, b, cons in s.sends():
                for c in cons:
                    out[(s.index, c)] = out.get((s.index, c), 0) + b
        return out


@dataclass
class CompileResult:
    """One input signature compiled for one rank: everything ``compile`` produced, typed, holding no
    process group. The runtime executes it; inspection, checkpoints and the cost model read it."""

    traced: object  # the Program as traced (before any pass): the cost model prices it
    program: object  # the Program after the program passes (TP)
    pipeline: PipelineProgram
    tp: object = None  # the TP pass's result (TpResult: which parameters it sharded, their layouts)
    zero3_buckets: dict[int, list] = field(default_factory=dict)  # stage -> its ZeRO-3 buckets
    predicted: dict = field(default_factory=dict)  # the profile the stage times are for (fxpar.cost.predict)
    timings: list[tuple[str, float]] = field(default_factory=list)  # (pass, seconds) in the order run
    # stage index -> what runs it instead of its GraphModule (the ``inductor`` pass; empty when eager)
    stage_fns: dict[int, object] = field(default_factory=dict)
