"""``Plan``: how to parallelise, as a small immutable value.

``Plan(pp=4, microbatches=8, schedule="1f1b")``, ``Plan.parse("pp=4,microbatches=8")``,
``Plan.from_file("plan.toml")`` (JSON or TOML; never pickle). Degrees multiply to the world size.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from fxpar.ir.errors import PlanError

SPLIT_WHERE = ("beginning", "end")
RECOMPUTE = ("none", "layer", "selective")


@dataclass(frozen=True)
class Plan:
    """A parallelisation plan: degrees that multiply to the world size, and how each runs."""

    dp: int = 1
    """Data-parallel replicas; each runs its slice of the global batch."""
    dp_replicate: int = 1
    """HSDP (with ZeRO): copies of the sharded state. ZeRO shards over groups of ``dp // dp_replicate`` ranks
    (the shard groups, neighbours in the mesh: inside a node) and each shard is replicated over
    ``dp_replicate`` groups; gradients are reduce-scattered inside a shard group, then each shard is
    all-reduced across the replicas. 1: ZeRO shards over all ``dp`` ranks."""
    pp: int = 1
    """Pipeline ranks."""
    tp: int = 1
    """Tensor-parallel ranks (innermost in the mesh)."""
    zero: Literal[0, 1, 2, 3] = 0
    """ZeRO stage: 1 shards optimizer states over dp, 2 also gradients, 3 also parameters."""
    microbatches: int | None = None
    """Chunks each step's batch is cut into, per replica (default: the number of stages)."""
    schedule: str = "1f1b"
    """``gpipe``, ``1f1b``, ``interleaved_1f1b``, ``zbv`` or ``interleaved_zb`` (torch's class names too)."""
    virtual_stages: int | None = None
    """Stages per pipeline rank for interleaved and V schedules (default 2 for those, 1 otherwise)."""
    split_points: dict[str, str] | None = field(default=None, hash=False)
    """Explicit cuts ``{"model.layers.16": "beginning"}`` instead of the cost-balanced ones (plan files)."""
    tp_plan: Any = "auto"
    """``"auto"`` (the model's ``base_model_tp_plan``, else inferred) or ``{fqn glob: style}`` (plan files)."""
    sequence_parallel: bool = False
    """Shard the activations between TP regions along the sequence (reduce-scatter / all-gather)."""
    bucket_mb: float | None = None
    """DDP / ZeRO-1/2 gradient buckets (default 25 MB); ZeRO-3 parameter buckets (default one per layer,
    consecutive layers merged up to this size)."""
    prefetch: int = 1
    """How many buckets ahead ZeRO-3 issues each gather (0: just before use)."""
    offload: bool = False
    """ZeRO-1/2: fp32 shards and optimizer states in CPU memory."""
    mixed_precision: Literal["bf16"] | None = None
    """``"bf16"``: forwards under bf16 autocast, ZeRO-3 gathers in bf16; master weights, gradients and
    their reductions stay fp32."""
    recompute: Literal["none", "layer", "selective"] = "none"
    """Activation recompute: ``layer`` recomputes each decoder layer's forward in backward (HF gradient
    checkpointing, full AC); ``selective`` keeps matmul outputs and recomputes the cheap ops between them."""
    compile: bool | None = None
    """True compiles each rank's stage graphs with torch.compile (Inductor), fxpar's collectives lowered
    to torch's functional ones so Inductor can overlap them; None: on for CUDA devices, off on the CPU
    (compiling costs seconds per graph there); False: never."""
    comm_dtype: Literal["int8"] | None = None
    """``"int8"``: ZeRO-3's parameter gathers go block-quantized (ZeRO++ qwZ: int8 codes + one fp32 scale
    per block of 256, quantized while packing the shard, dequantized after the gather): about half the
    bytes of bf16. Needs zero=3."""
    quantize_grads: bool = False
    """With ``comm_dtype="int8"``: ZeRO-3's gradient reduce-scatters go as int8 all-to-all with fp32
    accumulation on the receiving rank (ZeRO++ qgZ)."""
    collective_matmul: int = 0
    """Sequence-parallel TP: cut each all-gather -> matmul and matmul -> reduce-scatter into this many
    chunks, chunk i+1's communication in flight while chunk i multiplies (0: off). Needs
    sequence_parallel."""
    fused_loss: bool = False
    """Compute the LM head and the (vocabulary-parallel) cross-entropy in one chunked kernel, so the
    ``[tokens, vocab / tp]`` logits are never held whole."""
    ep: int = 1
    """Expert-parallel ranks, carved out of data parallelism: each MoE layer's experts are split over them
    (rank e holds experts ``[e * E / ep, (e + 1) * E / ep)``), tokens travel to their experts' rank by
    all-to-all; every one of the ``dp x ep`` replicas takes its own slice of the batch (docs/expert_parallel.md)."""

    def __post_init__(self):
        for name in ("dp", "pp", "tp", "ep", "dp_replicate"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise PlanError(f"Plan.{name}={v!r}: must be an integer >= 1")
        if self.zero not in (0, 1, 2, 3):
            raise PlanError(f"Plan.zero={self.zero!r}: ZeRO stage must be 0, 1, 2 or 3")
        if self.microbatches is not None and (not isinstance(self.microbatches, int) or self.microbatches < 1):
            raise PlanError(f"Plan.microbatches={self.microbatches!r}: must be an integer >= 1")
        if self.mixed_precision not in (None, "bf16"):
            raise PlanError(f"Plan.mixed_precision={self.mixed_precision!r}: use 'bf16' or leave it out")
        if self.offload and self.zero not in (1, 2):
            raise PlanError(f"offload keeps ZeRO-1/2's fp32 shards and optimizer states in CPU memory; zero={self.zero} "
                            "has none to offload: use zero=1 or zero=2")
        if self.prefetch < 0 or (self.bucket_mb is not None and self.bucket_mb < 0):
            raise PlanError(f"Plan.prefetch={self.prefetch!r}, bucket_mb={self.bucket_mb!r}: must be >= 0")
        if self.virtual_stages is not None and (not isinstance(self.virtual_stages, int) or self.virtual_stages < 1):
            raise PlanError(f"Plan.virtual_stages={self.virtual_stages!r}: must be an integer >= 1")
        if self.compile not in (None, True, False):
            raise PlanError(f"Plan.compile={self.compile!r}: use True, False or leave it out (None: on for CUDA)")
        if self.comm_dtype not in (None, "int8"):
            raise PlanError(f"Plan.comm_dtype={self.comm_dtype!r}: use 'int8' or leave it out")
        if self.comm_dtype is not None and self.zero != 3:
            raise PlanError(f"Plan.comm_dtype={self.comm_dtype!r} quantizes ZeRO-3's parameter gathers; "
                            f"zero={self.zero} has none: use zero=3")
        if self.quantize_grads and self.comm_dtype is None:
            raise PlanError("Plan.quantize_grads=True needs comm_dtype='int8' (and zero=3)")
        if not isinstance(self.collective_matmul, int) or self.collective_matmul < 0 \
                or self.collective_matmul == 1:
            raise PlanError(f"Plan.collective_matmul={self.collective_matmul!r}: use 0 (off) or a chunk count >= 2")
        if self.collective_matmul and not self.sequence_parallel:
            raise PlanError(f"Plan.collective_matmul={self.collective_matmul} overlaps sequence-parallel "
                            "all-gathers and reduce-scatters with matmuls: set sequence_parallel=True and tp > 1")
        if self.ep > 1 and self.tp > 1:
            raise PlanError(f"Plan(ep={self.ep}, tp={self.tp}): expert parallelism does not compose with tensor "
                            "parallelism yet (fxpar/passes/expert_parallel.py); use ep with dp and pp, or tp alone")
        if self.ep > 1 and self.zero == 3:
            raise PlanError(f"Plan(ep={self.ep}, zero=3): ZeRO-3 would shard the experts' slices again over dp "
                            "(fxpar/passes/expert_parallel.py does not compose with zero3); use zero=0, 1 or 2")
        if self.dp_replicate > 1:
            _check_hsdp(self)
        if self.recompute not in RECOMPUTE:
            raise PlanError(f"Plan.recompute={self.recompute!r}: use one of {RECOMPUTE}")
        for fqn, where in (self.split_points or {}).items():
            if where not in SPLIT_WHERE:
                raise PlanError(f"split_points[{fqn!r}]={where!r}: use one of {SPLIT_WHERE}")

    @property
    def world_size(self) -> int:
        return self.dp * self.ep * self.pp * self.tp

    @property
    def dp_shard(self) -> int:
        """Ranks each ZeRO shard group spans: ``dp // dp_replicate``."""
        return self.dp // self.dp_replicate

    @property
    def replicas(self) -> int:
        """Data replicas, each with its own slice of the batch: ``dp * ep`` (EP is carved out of dp)."""
        return self.dp * self.ep

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def parse(cls, text: str) -> Plan:
        """``"dp=2,pp=2,tp=2,zero=1,microbatches=4,schedule=1f1b"`` -> Plan."""
        known = {f.name: f for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        for item in filter(None, (s.strip() for s in text.split(","))):
            key, sep, value = item.partition("=")
            key = key.strip()
            if not sep or key not in known or key in ("split_points", "tp_plan"):
                raise PlanError(f"cannot read {item!r} in plan {text!r}; write key=value pairs with keys "
                                f"{[k for k in known if k not in ('split_points', 'tp_plan')]} "
                                "(split_points and tp_plan go in a plan file)")
            value = value.strip()
            kind = str(known[key].type)  # parsed by the field's type: a new field needs no parser change
            if kind.endswith("| None") and value.lower() in ("none", "auto", ""):
                kwargs[key] = None
            elif kind in ("bool", "bool | None"):
                kwargs[key] = value.lower() in ("1", "true", "yes", "on")
            elif kind.startswith("float"):
                try:
                    kwargs[key] = float(value)
                except ValueError:
                    raise PlanError(f"plan: {key}={value!r} is not a number") from None
            elif kind.startswith(("int", "Literal[0")):
                kwargs[key] = _int(key, value)
            else:
                kwargs[key] = value
        return cls(**kwargs)

    @classmethod
    def from_file(cls, path: str | Path) -> Plan:
        """A JSON or TOML file whose keys are Plan's fields (an optional ``[plan]`` table in TOML)."""
        path = Path(path)
        text = path.read_text()
        if path.suffix == ".toml":
            import tomllib

            data = tomllib.loads(text)
            data = data.get("plan", data)
        elif path.suffix == ".json":
            data = json.loads(text)
        else:
            raise PlanError(f"plan file {path}: use .json or .toml")
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise PlanError(f"plan file {path}: unknown keys {sorted(unknown)}")
        return cls(**data)


def _check_hsdp(plan: Plan) -> None:
    """``dp_replicate > 1`` (HSDP): a divisor of dp, with ZeRO, without expert parallelism."""
    r, dp = plan.dp_replicate, plan.dp
    if dp % r:
        fits = [d for d in range(2, dp + 1) if dp % d == 0]
        raise PlanError(f"Plan(dp={dp}, dp_replicate={r}): dp_replicate copies of the sharded state need "
                        f"dp_replicate to divide dp (shard groups of dp / dp_replicate ranks); use dp_replicate in "
                        f"{fits or [1]} or a dp that {r} divides")
    if plan.zero == 0:
        raise PlanError(f"Plan(dp={dp}, dp_replicate={r}, zero=0): without ZeRO every dp rank is a replica "
                        "already (nothing is sharded); use zero=1, 2 or 3 with dp_replicate, or leave dp_replicate=1")
    if plan.ep > 1:
        raise PlanError(f"Plan(dp={dp}, dp_replicate={r}, ep={plan.ep}): HSDP does not compose with expert "
                        "parallelism (expert slices reduce over dp, dense parameters over dp x ep); use "
                        "dp_replicate=1 with ep, or ep=1 with dp_replicate")


def _int(key: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise PlanError(f"plan: {key}={value!r} is not an integer") from None
