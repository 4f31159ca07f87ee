"""Node-metadata keys of the fxpar IR and what each one holds.

Every pass documents which of these it reads and writes. torch.export's own keys are kept as they are
(``val``: the FakeTensor (or tuple / SymInt) a node produces; ``nn_module_stack``: the module call stack
at the point the node was traced).

=====================  ==========================================================================
key                    value
=====================  ==========================================================================
``val``                torch.export's FakeTensor (shape, dtype, device) of the node's output
``fxpar.module``       FQN of the innermost module that owns the node ("" = the root module);
                       placeholders of parameters/buffers get the module that owns the tensor
``fxpar.param``        on placeholders bound to a parameter or buffer: its canonical FQN
``fxpar.cost``         :class:`fxpar.ir.meta.NodeCost`: estimated forward FLOPs and bytes
``fxpar.placement``    tuple of torch placements (``Shard(d)``, ``Replicate()``, ``Partial()``), one per mesh axis
``fxpar.zero3_bucket`` on a ZeRO-3 gather: the key of the parameter bucket it gathers
=====================  ==========================================================================
"""

from __future__ import annotations

from dataclasses import dataclass

VAL = "val"
NN_MODULE_STACK = "nn_module_stack"
MODULE = "fxpar.module"
PARAM = "fxpar.param"
COST = "fxpar.cost"
PLACEMENT = "fxpar.placement"
ZERO3_BUCKET = "fxpar.zero3_bucket"


@dataclass(frozen=True)
class NodeCost:
    """Estimated cost of one node for one forward call.

    ``flops``: floating-point operations of the forward (a multiply-add counts 2).
    ``bwd_flops``: the same for its backward (0 for nodes that need no gradient).
    ``bytes_read`` / ``bytes_written``: memory traffic, assuming no fusion; views move nothing.
    """

    flops: int = 0
    bwd_flops: int = 0
    bytes_read: int = 0
    bytes_written: int = 0

    def __add__(self, other: NodeCost) -> NodeCost:
        return NodeCost(self.flops + other.flops, self.bwd_flops + other.bwd_flops,
                        self.bytes_read + other.bytes_read, self.bytes_written + other.bytes_written)


ZERO_COST = NodeCost()
