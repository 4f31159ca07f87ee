"""``fxpar train``: fine-tune under torchrun (the loop is :class:`fxpar.train.loop.FineTune`).

MODEL is a ``save_pretrained`` directory (config.json, model.safetensors or sharded safetensors with their
index, and its tokenizer), a zoo name or an HF config.json. Data (required): ``--data FILE`` (plain
text, JSON lines with a text field, chat JSON lines with ``messages``, parquet; packed into ``--seq``
windows or, with ``--no-pack``, padded), ``--data synthetic`` for random tokens (a banner says so), or for
models without a tokenizer a text file read as bytes. Files over 8 MiB are streamed (``--streaming
auto|on|off``, ``--shuffle-buffer N``): each rank reads and tokenizes only its share. Optimisation as HF
Trainer: AdamW with weight-decay groups, ``--lr-scheduler`` with ``--warmup``, ``--max-grad-norm``,
``--grad-accum``, ``--bf16``. ``--eval-data`` / ``--eval-every``: evaluation loss and perplexity.
``--metrics-out`` (JSON lines), ``--tensorboard`` (when installed).
``--save DIR`` writes a checkpoint at the end (``--save-every K``: also every K steps;
``--save-total-limit N``: keep the newest N). ``--resume PATH`` continues from a ``step_N`` checkpoint or
a directory's latest (``--resume auto``: ``--save``'s latest when there is one), with the same losses as
an uninterrupted run, under any plan. ``--export DIR`` writes a Hugging Face model and its tokenizer at
the end. ``--lora r=16`` (``--lora-alpha``, ``--lora-targets``, ``--lora-dropout``) trains PEFT LoRA adapters
only; ``--export`` then writes the adapter PEFT loads (``--merge``: the merged model too). Rank 0 prints a
progress line: step, loss, lr, grad norm, tokens/s, tokens seen, epoch, elapsed time and ETA, memory per rank.
"""

from __future__ import annotations

import sys

from fxpar.train.config import FineTuneConfig
from fxpar.train.loop import FineTune, step_seed  # noqa: F401  (step_seed: the per-step RNG rule)


def run(args) -> int:
    FineTune(FineTuneConfig.from_args(args)).run()
    return 0


def add_arguments(p) -> None:
    """The options of ``fxpar train`` on ``p``, one per :class:`FineTuneConfig` field, its defaults."""
    p.add_argument("model", help="a save_pretrained directory, a zoo name (see `fxpar zoo`) or an HF config.json")
    p.add_argument("--plan",
                   help="degrees and options, e.g. dp=2,pp=2,tp=2,zero=1,microbatches=4, "
                        "or auto (fxpar.autoplan chooses)")
    p.add_argument("--plan-file", help="a JSON or TOML plan (never pickle)")
    p.add_argument("--steps", type=int, help="optimizer steps")
    p.add_argument("--batch", type=int,
                   help="global batch per accumulation step (sequences over all replicas)")
    p.add_argument("--grad-accum", type=int,
                   help="batches per optimizer step (the loss is the mean over all their label tokens)")
    p.add_argument("--seq", type=int, help="tokens per sequence")
    p.add_argument("--lr", type=float)
    p.add_argument("--lr-scheduler", help="transformers.get_scheduler name: constant, "
                   "linear, cosine, cosine_with_min_lr, ... (warm-up first)")
    p.add_argument("--warmup", type=float, help="warm-up steps (>= 1) or fraction of --steps (< 1)")
    p.add_argument("--weight-decay", type=float, help="AdamW decay; biases and norms undecayed")
    p.add_argument("--max-grad-norm", type=float,
                   help="clip the global gradient norm (every TP/PP/ZeRO shard counted once) to this; the "
                        "norm before clipping is logged ('inf': log it without clipping)")
    p.add_argument("--bf16", action="store_true", help="bf16 mixed precision (fp32 master weights)")
    p.add_argument("--seed", type=int)
    p.add_argument("--data", help="required: a data file (.txt, .jsonl, .parquet), or 'synthetic' "
                   "for random tokens (benchmarks, smoke tests)")
    p.add_argument("--format", choices=("auto", "text", "json", "chat", "parquet"))
    p.add_argument("--field", help="the text field of JSON lines / parquet rows")
    p.add_argument("--messages-field", help="the conversation field of chat rows")
    p.add_argument("--no-pack", action="store_true",
                   help="one document per row, padded (default: documents packed into --seq windows)")
    p.add_argument("--streaming", choices=("auto", "on", "off"),
                   help="read --data / --eval-data as streams, each rank reading and tokenizing only its share "
                        "(auto: text / JSON-lines files over 8 MiB; off: every rank reads the file whole)")
    p.add_argument("--shuffle-buffer", type=int,
                   help="streamed data: documents in the seeded shuffle buffer (0: file order)")
    p.add_argument("--tokenizer", help="tokenizer directory (default: the model directory)")
    p.add_argument("--eval-data", help="evaluation file (the same formats as --data)")
    p.add_argument("--eval-every", type=int, help="evaluate every K steps (-1: at the start and end)")
    p.add_argument("--meta", action="store_true", help="build on the meta device; weights from the initialiser")
    p.add_argument("--save", help="checkpoint directory: a checkpoint at the last step (and every "
                   "--save-every steps), each in DIR/step_N, DIR/latest naming the newest complete one")
    p.add_argument("--save-every", type=int, help="also save every K steps (needs --save)")
    p.add_argument("--save-total-limit", type=int,
                   help="keep only the newest N checkpoints in --save (never the one 'latest' names)")
    p.add_argument("--resume", help="a step_N checkpoint, or a directory of them (its latest); "
                   "'auto': --save's latest when there is one, else start at step 0 (for torchrun restarts)")
    p.add_argument("--export", help="write a Hugging Face model (config + safetensors) here; with --lora the "
                   "adapter as PEFT's save_pretrained writes it (adapter_model.safetensors, adapter_config.json)")
    p.add_argument("--lora", metavar="r=N", help="train LoRA adapters of rank N (PEFT's LoraConfig and "
                   "get_peft_model), the base weights frozen")
    p.add_argument("--lora-alpha", type=float, help="LoRA scale alpha (adapters scaled by alpha / r; PEFT's default)")
    p.add_argument("--lora-targets", help="modules to adapt, e.g. q_proj,v_proj, or all-linear "
                   "(default: PEFT's targets for the model type)")
    p.add_argument("--lora-dropout", type=float, help="dropout on the adapters' input (PEFT's default: 0)")
    p.add_argument("--merge", action="store_true", help="with --lora --export DIR: write the merged model "
                   "(from_pretrained loads it) to DIR and the adapter to DIR/adapter")
    p.add_argument("--log-every", type=int)
    p.add_argument("--metrics-out", help="append one JSON line per logged step / evaluation here")
    p.add_argument("--tensorboard", help="TensorBoard log directory (needs the tensorboard package)")
    p.add_argument("--losses-out", help="write every step's loss here (rank 0)")
    p.set_defaults(**FineTuneConfig.defaults())


def main(argv: list[str] | None = None) -> int:
    import argparse

    from fxpar.ir.errors import FxparError

    p = argparse.ArgumentParser(prog="fxpar train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    try:
        return run(p.parse_args(argv))
    except FxparError as e:
        print(f"fxpar: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
