"""``Plan``: how to parallelise, as a small immutable value.

``Plan(pp=4, microbatches=8, schedule="1f1b")``, ``Plan.parse("pp=4,microbatches=8")``,
``Plan.from_file("plan.toml")`` (JSON or TOML; never pickle). Degrees multiply to the world size.
"""

from __future__ import annotations

import difflib
import functools
import json
import re
import types
import typing
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

import torch

from fxpar.ir.errors import PlanError
from fxpar.ir.plan_checks import check_combinations, check_hsdp
from fxpar.ir.resolved import resolve
from fxpar.ir.schedule import normalize_schedule

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
    """``"auto"`` (the model's ``base_model_tp_plan``, else inferred) or ``{fqn glob: style}`` (plan files),
    used exactly as written."""
    tp_replicate: tuple[str, ...] = ()
    """Module FQN globs kept whole on every TP rank (style ``replicate``), on top of whichever ``tp_plan``
    applies: ``--plan tp=4,tp_replicate=model.embed_tokens+lm_head`` (``+`` between globs), a list in a file."""
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
    base_dtype: Literal["int8", "nf4"] | None = None  # QLoRA: frozen linear weights in blocks (passes/quantize_base.py)
    quantize_grads: bool = False
    """With ``comm_dtype="int8"``: ZeRO-3's gradient reduce-scatters as int8 all-to-all, fp32 sums (ZeRO++ qgZ)."""
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
    cp: int = 1
    """Context-parallel ranks: each token input's sequence is split over them (two chunks per rank, one from
    the head and one from the tail, so causal attention is balanced), attention gathers each layer's keys and
    values over them; they share their replica's slice of the batch, and gradients reduce (ZeRO shards) over
    ``dp x cp`` (docs/context_parallel.md)."""
    cp_attention: Literal["allgather", "ulysses", "auto"] = "allgather"
    """Attention across cp: ``allgather`` gathers keys and values; ``ulysses`` sends queries, keys, values and
    output by all-to-all, each rank attending with ``heads / cp`` heads over the whole sequence, where cp divides
    the heads (else the all-gather; ``fxpar inspect`` says why); ``auto``: per attention, the fewer bytes."""

    def __post_init__(self):
        if isinstance(self.tp_replicate, (list, str)):  # a list from JSON / Python, one glob as a string
            object.__setattr__(self, "tp_replicate", (self.tp_replicate,) if isinstance(self.tp_replicate, str)
                               else tuple(self.tp_replicate))
        check_types(self)
        try:
            normalize_schedule(self.schedule)
        except PlanError as e:
            raise PlanError(f"Plan.schedule={self.schedule!r}: {e}") from None
        for name in ("dp", "pp", "tp", "ep", "cp", "dp_replicate"):
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
            raise PlanError("offload keeps ZeRO-1/2's fp32 shards and optimizer states in CPU memory; "
                            f"zero={self.zero} has none to offload: use zero=1 or zero=2")
        if self.prefetch < 0 or (self.bucket_mb is not None and self.bucket_mb < 0):
            raise PlanError(f"Plan.prefetch={self.prefetch!r}, bucket_mb={self.bucket_mb!r}: must be >= 0")
        if self.virtual_stages is not None and (not isinstance(self.virtual_stages, int) or self.virtual_stages < 1):
            raise PlanError(f"Plan.virtual_stages={self.virtual_stages!r}: must be an integer >= 1")
        if self.compile not in (None, True, False):
            raise PlanError(f"Plan.compile={self.compile!r}: use True, False or leave it out (None: on for CUDA)")
        check_combinations(self)
        if self.dp_replicate > 1:
            check_hsdp(self)
        if self.recompute not in RECOMPUTE:
            raise PlanError(f"Plan.recompute={self.recompute!r}: use one of {RECOMPUTE}")
        for fqn, where in (self.split_points or {}).items():
            if where not in SPLIT_WHERE:
                raise PlanError(f"split_points[{fqn!r}]={where!r}: use one of {SPLIT_WHERE}")

    @property
    def world_size(self) -> int:
        return self.dp * self.ep * self.pp * self.cp * self.tp

    @property
    def dp_shard(self) -> int:
        """Ranks each ZeRO shard group spans: ``dp // dp_replicate``."""
        return self.dp // self.dp_replicate

    @property
    def replicas(self) -> int:
        """Data replicas, each with its own slice of the batch: ``dp * ep`` (EP is carved out of dp)."""
        return self.dp * self.ep

    def compiles_on(self, device) -> bool:
        """What ``compile`` means on ``device``: None is on for CUDA and off elsewhere."""
        return self.compile if self.compile is not None else torch.device(device).type == "cuda"

    def resolve(self, world: int, batch: int):
        """This plan for ``world`` ranks and a global ``batch``: a frozen :class:`~fxpar.ir.resolved.Resolved`,
        every default and derived value (stages, microbatches and size, buckets, dp axis) checked together."""
        return resolve(self, world, batch)

    def to_text(self) -> str:
        """The fields that differ from the defaults, as :meth:`parse` reads them (``dp=4,pp=2,zero=1``)."""
        default, values = Plan(), {f.name: getattr(self, f.name) for f in fields(Plan)}
        items = [f"{k}={'+'.join(v) if isinstance(v, tuple) else v}" for k, v in values.items()
                 if k in ("dp", "pp", "tp") or v != getattr(default, k)]
        return ",".join(items).replace("=True", "=true").replace("=False", "=false")

    def to_dict(self) -> dict:
        """The fields as plain JSON-able values (``tp_replicate`` as a list), what ``Plan(**d)`` reads back."""
        return {**asdict(self), "tp_replicate": list(self.tp_replicate)}

    @classmethod
    def parse(cls, text: str) -> Plan:
        """``"dp=2,pp=2,tp=2,zero=1,microbatches=4,schedule=1f1b"`` -> Plan. Each value is read by its field's
        type (:func:`field_value`); an unknown key, a key given twice or a value of the wrong kind is a
        :class:`PlanError` naming the key, the value and what is accepted."""
        kwargs: dict[str, Any] = {}
        for item in filter(None, (s.strip() for s in text.split(","))):
            key, sep, value = (part.strip() for part in item.partition("="))
            if not sep and key.lower() == "auto":
                raise PlanError(f"plan {text!r}: 'auto' is chosen by the planner, not parsed: fxpar plan --auto "
                                "--world N, fxpar train --plan auto, or fxpar.compile(model, 'auto')")
            if not sep:
                raise PlanError(f"plan {text!r}: cannot read {item!r}; write key=value pairs, e.g. dp=2,tp=2")
            if key not in _TEXT_KEYS:
                raise PlanError(f"plan {text!r}: cannot read {item!r}: {_unknown(key, _TEXT_KEYS)}"
                                if key not in _types() else
                                f"plan {text!r}: cannot read {item!r}: {key} is a table of strings; it goes in a plan "
                                f"file (--plan-file plan.toml or plan.json)")
            if key in kwargs:
                raise PlanError(f"plan {text!r}: {key} is given twice; give each key once")
            kwargs[key] = field_value(key, value, f"plan {text!r}")
        return cls(**kwargs)

    @classmethod
    def from_file(cls, path: str | Path) -> Plan:
        """A JSON or TOML file whose keys are Plan's fields (an optional ``[plan]`` table in TOML). Values are
        read by their field's types as in :meth:`parse` (a string is read as ``--plan`` reads it; a boolean
        field takes a JSON/TOML boolean or 0/1)."""
        path = Path(path)
        if path.suffix not in (".toml", ".json"):
            raise PlanError(f"plan file {path}: use .json or .toml")
        try:
            text = path.read_text()
        except OSError as e:
            raise PlanError(f"plan file {path}: cannot read it ({e.strerror or e})") from None
        try:
            if path.suffix == ".toml":
                import tomllib

                data = tomllib.loads(text)
                data = data.get("plan", data)
            else:
                data = json.loads(text)
        except ValueError as e:  # tomllib.TOMLDecodeError and json.JSONDecodeError are ValueErrors
            raise PlanError(f"plan file {path}: not valid {path.suffix[1:].upper()}: {e}") from None
        if not isinstance(data, dict):
            raise PlanError(f"plan file {path}: holds a {type(data).__name__}; write a table of Plan fields, "
                            "e.g. {\"dp\": 2, \"tp\": 2}")
        unknown = sorted(set(data) - set(_types()))
        if unknown:
            raise PlanError(f"plan file {path}: " + "; ".join(_unknown(k, _types()) for k in unknown))
        return cls(**{k: field_value(k, v, f"plan file {path}") for k, v in data.items()})


@functools.cache
def _types() -> dict[str, Any]:
    """Field name -> its type (the annotations evaluated)."""
    return typing.get_type_hints(Plan)


_MAPPINGS = ("split_points", "tp_plan")  # mappings: plan files only
_TEXT_KEYS = tuple(f.name for f in fields(Plan) if f.name not in _MAPPINGS)
_TRUE, _FALSE = ("true", "1"), ("false", "0")


def _unknown(key: str, known) -> str:
    """'unknown key 'x'; did you mean 'y'? (keys: ...)' with difflib's nearest key."""
    near = difflib.get_close_matches(key, list(known), n=1, cutoff=0.0)
    return f"unknown key {key!r}; did you mean {near[0]!r}? (keys: {', '.join(known)})" if near else \
        f"unknown key {key!r} (keys: {', '.join(known)})"


def _split_type(hint) -> tuple[Any, bool]:
    """(the type besides None, whether None is allowed) of an annotation like ``int | None``."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(hint) if a is not type(None)]
        return (rest[0] if len(rest) == 1 else typing.Union[tuple(rest)]), len(rest) < len(typing.get_args(hint))
    return hint, False


def _accepted(hint) -> str:
    """What a field of type ``hint`` accepts, in words."""
    base, optional = _split_type(hint)
    none = " or none" if optional else ""
    if base is bool:
        return "true, false, 1 or 0" + none
    if base is int:
        return "an integer" + none
    if base is float:
        return "a number" + none
    if typing.get_origin(base) is typing.Literal:
        return "one of " + ", ".join(str(c) for c in typing.get_args(base)) + none
    if typing.get_origin(base) is tuple:
        return "module globs joined by '+' (a list of strings in a file)"
    if typing.get_origin(base) is dict:
        return "a table of strings (plan files)" + none
    if base is str:
        return "a name"
    return "'auto' or a table of {fqn glob: style} (plan files)"


def field_value(key: str, value: Any, where: str = "plan") -> Any:
    """``value`` for field ``key``, read by the field's type: a string as ``--plan`` writes it (booleans
    ``true``/``false``/``1``/``0`` in any case, integers, numbers, a choice, ``none``/``auto`` where None is
    allowed), or a JSON/TOML value (a boolean field also takes 0 and 1, a number field an integer). Raises
    :class:`PlanError` naming ``where``, the key, the value and what the field accepts."""
    hint = _types()[key]
    base, optional = _split_type(hint)

    def bad():
        return PlanError(f"{where}: {key}={value!r}: {key} takes {_accepted(hint)}")

    if isinstance(value, str):
        text = value.strip()
        low = text.lower()
        if optional and low in ("none", "auto", ""):
            return None
        if base is bool:
            if low in _TRUE + _FALSE:
                return low in _TRUE
            raise bad()
        if base is int or (typing.get_origin(base) is typing.Literal and all(
                type(c) is int for c in typing.get_args(base))):
            if not _INT.fullmatch(text):
                raise bad()
            value = int(text)
        elif base is float:
            try:
                return float(text)
            except ValueError:
                raise bad() from None
        elif typing.get_origin(base) is tuple:
            return tuple(g.strip() for g in text.split("+") if g.strip())
        elif typing.get_origin(base) is typing.Literal:  # a name among the choices, in any case
            value = next((c for c in typing.get_args(base) if str(c).lower() == low), text)
        else:
            value = text
    elif base is bool and type(value) is int and value in (0, 1):  # a file's 0 / 1
        value = bool(value)
    elif base is float and type(value) is int:
        value = float(value)
    elif typing.get_origin(base) is tuple and isinstance(value, list):
        value = tuple(value)
    if value is None and not optional and base is not Any:
        raise bad()
    if value is not None and not _is_type(value, base):
        raise bad()
    return value


_INT = re.compile(r"[+-]?[0-9]+")


def _is_type(value: Any, base) -> bool:
    """Whether ``value`` is of type ``base`` (bool is not an int here; Literal choices exactly)."""
    origin = typing.get_origin(base)
    if base is Any:
        return True
    if base is bool:
        return type(value) is bool
    if base is int:
        return type(value) is int
    if base is float:
        return type(value) in (int, float)
    if origin is typing.Literal:
        return any(type(value) is type(c) and value == c for c in typing.get_args(base))
    if origin is tuple:
        return isinstance(value, tuple) and all(isinstance(v, str) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())
    return isinstance(value, base)


@functools.cache
def _field_types() -> tuple[tuple[str, Any, bool], ...]:
    """(name, type, whether None is allowed) per field of Plan, worked out once (the planner builds thousands)."""
    return tuple((f.name, *_split_type(_types()[f.name])) for f in fields(Plan))


@functools.lru_cache(maxsize=4096)
def _value_ok(name: str, kind: type, value) -> bool:
    """Whether ``value`` (of type ``kind``: True and 1 are one key otherwise) may be field ``name``'s."""
    base, optional = next((b, o) for n, b, o in _field_types() if n == name)
    if value is None:
        return optional or base is Any
    return _is_type(value, base)


def check_types(plan: Plan) -> None:
    """Every field of ``plan`` of its declared type (``Plan(sequence_parallel="yes")`` is an error, not a
    truthy string); ``tp_plan`` is ``"auto"`` or a ``{glob: style}`` table of strings."""
    for name, _, _ in _field_types():
        value = getattr(plan, name)
        try:  # the planner builds thousands of plans from a few values per field: each (field, value) once
            ok = _value_ok(name, type(value), value)
        except TypeError:  # unhashable (a table)
            ok = _value_ok.__wrapped__(name, type(value), value)
        if not ok:
            raise PlanError(f"Plan.{name}={value!r}: {name} takes {_accepted(_types()[name])}")
    tp_plan = plan.tp_plan
    if tp_plan != "auto" and not (isinstance(tp_plan, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in tp_plan.items())):
        raise PlanError(f"Plan.tp_plan={tp_plan!r}: use 'auto' or a table of {{module glob: style}} "
                        "(e.g. {'model.layers.*.mlp.up_proj': 'colwise'})")
