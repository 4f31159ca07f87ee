"""``Plan``: how to parallelise, as a small immutable value.

``Plan(pp=4, microbatches=8, schedule="1f1b")``, ``Plan.parse("pp=4,microbatches=8")``,
``Plan.from_file("plan.toml")`` (JSON or TOML; never pickle). Degrees multiply to the world size.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from fxpar.ir.errors import PlanError

SPLIT_WHERE = ("beginning", "end")


@dataclass(frozen=True)
class Plan:
    """A parallelisation plan.

    ``pp``: pipeline ranks; ``virtual_stages``: stages per pipeline rank (interleaved and V schedules;
    default 2 for those, 1 otherwise); ``microbatches``: chunks each step's batch is cut into (default:
    the number of stages); ``schedule``: ``gpipe``, ``1f1b``, ``interleaved_1f1b``, ``zbv`` or
    ``interleaved_zb``; ``split_points``: explicit cuts ``{"model.layers.16": "beginning"}`` instead of
    the cost-balanced ones. ``dp``, ``tp``, ``zero``, ``tp_plan`` and ``sequence_parallel`` are the data-
    and tensor-parallel degrees and options. ``bucket_mb``: gradient buckets of DDP / ZeRO-1/2 (default
    25 MB) and parameter buckets of ZeRO-3 (default: one per layer; consecutive layers merged up to
    this size); ``prefetch``: how many buckets ahead ZeRO-3 issues each gather (0: just before use);
    ``offload``: ZeRO-1/2 optimizer states and fp32 shards in CPU memory; ``mixed_precision="bf16"``:
    forwards under bf16 autocast, ZeRO-3 gathers parameters in bf16, master weights, gradients and
    their reductions stay fp32.
    """

    dp: int = 1
    pp: int = 1
    tp: int = 1
    zero: int = 0
    microbatches: int | None = None
    schedule: str = "1f1b"
    virtual_stages: int | None = None
    split_points: dict[str, str] | None = field(default=None, hash=False)
    tp_plan: Any = "auto"
    sequence_parallel: bool = False
    bucket_mb: float | None = None
    prefetch: int = 1
    offload: bool = False
    mixed_precision: str | None = None

    def __post_init__(self):
        for name in ("dp", "pp", "tp"):
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
        for fqn, where in (self.split_points or {}).items():
            if where not in SPLIT_WHERE:
                raise PlanError(f"split_points[{fqn!r}]={where!r}: use one of {SPLIT_WHERE}")

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

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
            if key in ("sequence_parallel", "offload"):
                kwargs[key] = value.lower() in ("1", "true", "yes", "on")
            elif key == "bucket_mb":
                try:
                    kwargs[key] = float(value)
                except ValueError:
                    raise PlanError(f"plan: bucket_mb={value!r} is not a number") from None
            else:
                kwargs[key] = value if key in ("schedule", "mixed_precision") else _int(key, value)
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


def _int(key: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise PlanError(f"plan: {key}={value!r} is not an integer") from None
