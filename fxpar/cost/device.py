"""A roofline device model: the time of a node is the larger of its compute and its memory traffic.

Used to weigh nodes against each other (a vocabulary-sized matmul against a memory-bound loss over the
same logits) and against pipeline transfers. The figures are sustained rates, not peaks; only their
ratios matter for balancing, the absolute values for predicted step times.
"""

from __future__ import annotations

from dataclasses import dataclass

from fxpar.ir.meta import NodeCost


@dataclass(frozen=True)
class DeviceModel:
    name: str
    flops: float  # sustained matmul FLOP/s
    mem_bw: float  # sustained HBM / DRAM bytes/s
    link_bw: float  # point-to-point bytes/s between pipeline neighbours
    link_latency: float  # seconds per message

    def node_time(self, cost: NodeCost) -> tuple[float, float]:
        """(forward, backward) seconds of one node."""
        traffic = cost.bytes_read + cost.bytes_written
        fwd = max(cost.flops / self.flops, traffic / self.mem_bw)
        bwd = max(cost.bwd_flops / self.flops, 2 * traffic / self.mem_bw) if cost.bwd_flops else 0.0
        return fwd, bwd

    def transfer_time(self, nbytes: int, messages: int = 1) -> float:
        return nbytes / self.link_bw + messages * self.link_latency if nbytes else 0.0


# H100 SXM, bf16: about half of the 989 TFLOP/s dense peak sustained, 3.35 TB/s HBM at ~80%, and
# ~25 GB/s per direction for an inter-node pipeline hop (NDR InfiniBand, one NIC per GPU).
H100 = DeviceModel("H100-SXM", flops=450e12, mem_bw=2.7e12, link_bw=25e9, link_latency=10e-6)
# A CPU core running gloo: matters only for predicted bubbles in tests on this kind of machine.
CPU = DeviceModel("CPU-core", flops=50e9, mem_bw=10e9, link_bw=2e9, link_latency=50e-6)
