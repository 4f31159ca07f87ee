"""The hand-written kernels a compiled model runs on this rank, and which path each takes.

Reads: the stage graphs of a compiled model (``torch.ops.fxpar_kernels.*`` nodes, and ZeRO-3 gathers
that go quantized) and its plan (the data-parallel engine's bucket kernels, which run outside the
graphs). Writes nothing.

Every kernel of ``fxpar.runtime.kernels`` has a Triton path and a torch path and picks by the tensors'
device: Triton on CUDA (where triton is installed), torch elsewhere. The report says which path this
rank's device takes; it does not import the runtime (the layering), so it names the ops by their
qualified names.
"""

from __future__ import annotations

import importlib.util
from collections import Counter

import torch

from fxpar.ir.collectives import collective
from fxpar.ir.kernel_catalogue import KERNELS
from fxpar.ir.ops import collective_kind
from fxpar.ir.rank_view import view_of


def kernel_path(device: torch.device | str) -> str:
    """``"triton"`` or ``"torch"``: the path fxpar's kernels take for tensors on ``device``."""
    cuda = torch.device(device).type == "cuda"
    return "triton" if cuda and importlib.util.find_spec("triton") is not None else "torch"


def kernel_rows(compiled) -> list[dict]:
    """One row per kernel this rank runs: name, where (stage graphs or the data-parallel engine), how
    many call sites, what it does, and the path on this rank's device."""
    v = view_of(compiled)
    path = kernel_path(v.device)
    found: Counter = Counter()
    for stage in v.my_stages():
        for gm in (m for m in stage.gm.modules() if isinstance(m, torch.fx.GraphModule)):
            for node in gm.graph.nodes:
                name = _fused_name(node)
                if name is not None:
                    found[(name, f"stage {stage.index}")] += 1
                if _quantized_gather(node):
                    found[("quantize_shard", f"stage {stage.index}")] += 1
                    found[("dequantize_copy_out", f"stage {stage.index}")] += 1
    rows = [{"kernel": name, "where": where, "sites": n, "what": _what(name),
             "path": path if name not in KERNELS or KERNELS[name].triton else "torch"}
            for (name, where), n in sorted(found.items())]
    engine = v.data_parallel
    for name in engine.kernels if engine is not None else ():  # the engine names the bucket kernels it launches
        rows.append({"kernel": name, "where": "data-parallel engine", "sites": len(engine.buckets),
                     "what": _what(name), "path": path})
    return rows


def _what(name: str) -> str:
    return KERNELS[name].what if name in KERNELS else ""


def _fused_name(node: torch.fx.Node) -> str | None:
    if node.op != "call_function":
        return None
    packet = getattr(node.target, "overloadpacket", None)
    namespace, _, name = getattr(packet, "_qualified_op_name", "").partition("::")
    return name if namespace == "fxpar_kernels" else None


def _quantized_gather(node: torch.fx.Node) -> bool:
    """Whether the node is an all-gather sent in a wire format (its record's ``comm_dtype_arg``): the
    quantize copy-in and dequantize copy-out kernels run around it."""
    kind = collective_kind(node)
    rec = collective(kind) if kind is not None else None
    if rec is None or rec.kernel != "all_gather" or rec.comm_dtype_arg is None:
        return False
    at = rec.comm_dtype_arg
    return (node.args[at] if len(node.args) > at else node.kwargs.get("comm_dtype")) is not None


def format_kernel_rows(rows: list[dict]) -> str:
    if not rows:
        return "kernels: none of fxpar's hand-written kernels (every op is torch's or Inductor's)"
    lines = ["kernels (fxpar.runtime.kernels) on this rank:"]
    for r in rows:
        lines.append(f"  {r['kernel']} [{r['path']}] in {r['where']} x{r['sites']}: {r['what']}")
    return "\n".join(lines)
