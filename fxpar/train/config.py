"""The options of one fine-tuning run: :class:`FineTuneConfig`, what :class:`fxpar.train.loop.FineTune` is
built from. ``fxpar train`` maps its command line onto it (``fxpar.cli.train``: each flag the field of the
same name, the defaults read from here); Python callers build it directly.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class FineTuneConfig:
    """One run's options; ``fxpar train --help`` says what each does (``--grad-accum`` is ``grad_accum``)."""

    model: str  # a save_pretrained directory, a zoo name or an HF config.json
    plan: str = "dp=1"  # degrees and options, or "auto"
    plan_file: str | None = None
    steps: int = 10  # optimizer steps
    batch: int = 8  # global batch per accumulation step
    grad_accum: int = 1
    seq: int = 32
    lr: float = 1e-3
    lr_scheduler: str = "constant"
    warmup: float = 0  # steps (>= 1) or a fraction of the steps (< 1)
    weight_decay: float = 0.0
    max_grad_norm: float | None = None
    bf16: bool = False
    seed: int = 0
    data: str | None = None  # required: a file or "synthetic"
    format: str = "auto"
    field: str = "text"
    messages_field: str = "messages"
    no_pack: bool = False
    streaming: str = "auto"
    shuffle_buffer: int = 1000
    tokenizer: str | None = None
    eval_data: str | None = None
    eval_every: int = -1
    meta: bool = False
    save: str | None = None
    save_every: int = 0
    save_total_limit: int | None = None
    resume: str | None = None
    export: str | None = None
    lora: str | None = None  # "r=16": train LoRA adapters (fxpar.train.lora), the base frozen
    lora_alpha: float | None = None  # None: PEFT's defaults, as for the two below
    lora_targets: str | None = None
    lora_dropout: float | None = None
    merge: bool = False  # with lora and export: the merged model too
    log_every: int = 1
    metrics_out: str | None = None
    tensorboard: str | None = None
    losses_out: str | None = None

    @classmethod
    def defaults(cls) -> dict:
        """Every option's default by field name (the command line's defaults)."""
        return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}

    @classmethod
    def of(cls, config=None, **options) -> FineTuneConfig:
        """``config`` itself, a config of the fields ``options``, or of a parsed command line ``config``
        (an ``argparse.Namespace``: ``FineTune(parser.parse_args(argv))`` as before the config existed)."""
        if config is None:
            return cls(**options)
        if options:
            raise TypeError(f"give a FineTuneConfig or its fields as keywords, not both ({sorted(options)})")
        return config if isinstance(config, cls) else cls.from_args(config)

    @classmethod
    def from_args(cls, args) -> FineTuneConfig:
        """The config of a parsed command line (an ``argparse.Namespace`` with a field per option)."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
