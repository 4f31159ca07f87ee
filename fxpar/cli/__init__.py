"""``fxpar`` / ``python -m fxpar``: the command line.

Examples::

    fxpar inspect llama                         # module table of the built-in tiny Llama
    fxpar inspect llama --graph --module model.layers.0.self_attn
    fxpar inspect path/to/config.json --meta --batch 1 --seq 4096 --depth 2
    fxpar inspect gpt2 --json > gpt2.json       # the same data for machines
    fxpar inspect qwen2 --dot out/qwen2.dot     # DOT picture (and SVG where graphviz is installed)
    fxpar zoo                                   # the built-in tiny models
    fxpar plan llama --plan dp=2,pp=2,tp=2,zero=1 # what a plan does on 8 ranks: stages, collectives, memory
    fxpar calibrate --world 8                    # measure this host, write ~/.cache/fxpar/profile.json
    fxpar plan examples/configs/llama3-70b.json --meta --auto --world 1024 --device h100-80gb \
        --global-batch 1024 --seq 8192             # the best plan, the top 5, the hand-made baseline
    fxpar inspect gpt2 --plan tp=2               # + what TP cuts per module, what it leaves whole and why
    torchrun --nproc_per_node 8 -m fxpar train llama --plan dp=2,pp=2,tp=2,zero=1 --data synthetic --steps 5
    fxpar launch --nproc_per_node 8 train llama --plan dp=2,pp=2,tp=2,zero=1 --data synthetic --steps 5
                                                 # the same through torchrun; a failure is one message
    torchrun --nproc_per_node 2 -m fxpar train config.json --meta --plan pp=2 --data notes.txt \
        --save ckpt --save-every 50 --export out/
    torchrun --nproc_per_node 4 -m fxpar train llama --plan dp=4 --data synthetic --resume ckpt
                                                 # load under another plan
    torchrun --nproc_per_node 2 -m fxpar generate out/ --plan tp=2 --chat --prompt "Hi" --max-new-tokens 32
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import logging
import os
import sys

from fxpar.cli import failures
from fxpar.cli.calibrate import add_arguments as add_calibrate_arguments
from fxpar.cli.calibrate import cmd_calibrate
from fxpar.cli.generate import add_arguments as add_generate_arguments
from fxpar.cli.generate import run as cmd_generate
from fxpar.cli.inspect import cmd_inspect
from fxpar.cli.plan import cmd_plan
from fxpar.cli.train import add_arguments
from fxpar.cli.train import run as cmd_train

EPILOG = __doc__.split("Examples::", 1)[1]


def cmd_zoo(args) -> int:
    from fxpar import zoo

    for name in zoo.ZOO_NAMES:
        print(f"{name:12s} {zoo.model_kind(name)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fxpar", description="Trace, inspect and parallelise PyTorch models.",
                                     epilog="examples:" + EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="trace a model and print its module table / graph / picture",
                       epilog="examples:" + EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="zoo name (see `fxpar zoo`) or path to a Hugging Face config.json")
    p.add_argument("--frontend", default="auto", choices=("auto", "export", "hf_fx"))
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    p.add_argument("--meta", action="store_true", help="build on the meta device (no weights allocated)")
    p.add_argument("--module", default=None, help="restrict table and graph to this module FQN")
    p.add_argument("--depth", type=int, default=3, help="module levels in the table (-1: all)")
    p.add_argument("--graph", action="store_true", help="print the readable graph")
    p.add_argument("--dot", default=None, help="write a DOT picture here (and SVG where graphviz is installed)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--plan", default=None, help="with tp > 1 (e.g. tp=2): also what the plan's tensor parallelism "
                   "cuts and leaves whole per module, and why")
    p.set_defaults(func=cmd_inspect)
    sub.add_parser("launch", add_help=False, help="torchrun -m fxpar COMMAND, a failure reported in one message: "
                   "fxpar launch [torchrun options] COMMAND [args]")  # main runs it (fxpar.cli.launch)
    z = sub.add_parser("zoo", help="list the built-in tiny models")
    z.set_defaults(func=cmd_zoo)
    t = sub.add_parser("train", help="train under torchrun (see examples below)", epilog="examples:" + EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(t)
    t.set_defaults(func=cmd_train)
    g = sub.add_parser("generate", help="generate text from a model directory under any plan (torchrun or one "
                       "process)", epilog="examples:" + EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_generate_arguments(g)
    g.set_defaults(func=cmd_generate)
    q = sub.add_parser("plan", help="what a plan does (stages, collectives, memory) without launching",
                       epilog="examples:" + EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    q.add_argument("model")
    q.add_argument("--plan", default="dp=1")
    q.add_argument("--plan-file", default=None)
    q.add_argument("--batch", type=int, default=8, help="global batch (sequences), as fxpar train's --batch")
    q.add_argument("--seq", type=int, default=32, help="tokens per sequence, as fxpar train's --seq")
    q.add_argument("--meta", action="store_true")
    q.add_argument("--json", action="store_true", help="print the plan's report as JSON")
    q.add_argument("--lora", metavar="r=N", help="price LoRA adapters of rank N, as fxpar train --lora (the base "
                   "frozen: its shard, the adapters, their AdamW state and the activations per rank)")
    for flag, kind in (("--lora-alpha", float), ("--lora-targets", str), ("--lora-dropout", float)):
        q.add_argument(flag, type=kind, help=f"with --lora: as fxpar train {flag}")
    q.add_argument("--auto", action="store_true", help="choose the plan: the best for --world ranks of --device, "
                   "the top alternatives, the hand-made baseline, why the others lost")
    q.add_argument("--world", type=int, default=None, help="with --auto: the number of ranks")
    q.add_argument("--device", default=None, help="the device profile the times are for: a name (h100-80gb, "
                   "h200-141gb, a100-80gb, cpu) or a profile JSON written by `fxpar calibrate` (default: this "
                   "machine's GPU, else the CPU profile `fxpar calibrate` wrote, else the built-in cpu one)")
    q.add_argument("--global-batch", type=int, default=None, help="with --auto: sequences per optimizer step "
                   "(default --batch)")
    q.add_argument("--memory", default=None, help="with --auto: memory per rank, e.g. 80GB (default: the profile's)")
    q.add_argument("--top", type=int, default=5, help="with --auto: alternatives shown")
    q.add_argument("--dtype", default=None, choices=("fp32", "bf16", "fp16"), help="with --auto: how the step "
                   "computes (default: the model's parameter dtype, e.g. the config's torch_dtype)")
    q.set_defaults(func=cmd_plan)
    c = sub.add_parser("calibrate", help="measure this machine and write a device profile for the planner")
    add_calibrate_arguments(c)
    c.set_defaults(func=cmd_calibrate)
    return parser


def _commands(parser: argparse.ArgumentParser) -> tuple[str, ...]:
    return tuple(next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices)


class _Stderr(logging.StreamHandler):
    """A handler writing to ``sys.stderr`` as it is when a record comes, not as it was when the handler was
    made (as logging's own last-resort handler does): a caller that swaps stderr (pytest's capture, a
    redirect) and closes its stream later leaves no handler writing to a closed file."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


@contextlib.contextmanager
def _logging():
    """fxpar's own news (a program compiled for new input shapes, a dropped one) on stderr, one line each, for
    the duration of a command (a caller that configured the ``fxpar`` logger itself keeps its set-up). Under a
    launcher rank 0 speaks for the job: the other ranks show only warnings and errors, named by rank (the ranks
    run the same program, so their INFO lines would repeat rank 0's)."""
    logger = logging.getLogger("fxpar")
    if logger.handlers:
        yield
        return
    rank = failures.rank() if failures.multi_rank() else 0
    handler = _Stderr()
    handler.setFormatter(logging.Formatter("%(message)s" if rank == 0 else f"rank {rank}: %(message)s"))
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    try:
        yield
    finally:  # a command run in-process (a test, a notebook) leaves the logger as it found it
        logger.removeHandler(handler)
        logger.setLevel(level)


# commands that join no process group and write nothing but their output: their process may end at once
QUICK_EXIT = ("plan", "inspect", "zoo")


def run() -> None:
    """The ``fxpar`` console script and ``python -m fxpar``: :func:`main`, then the process ends. After a
    command of :data:`QUICK_EXIT` it ends without the interpreter's teardown: freeing torch's and the
    libraries' modules took 1.0-2.6 s on this project's 2-core host (``import torch.distributed.tensor``
    alone: 1.0-1.5 s), more than planning a 70B model's search. Exit handlers run and output is flushed
    first; a command that joined a process group ends the usual way."""
    argv = sys.argv[1:]
    rc = main(argv)
    if argv[:1] and argv[0] in QUICK_EXIT and not _joined():
        logging.shutdown()
        atexit._run_exitfuncs()  # what the interpreter runs at exit (torch's and tempfile's handlers among them)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    sys.exit(rc)


def _joined() -> bool:
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns its exit status (0; 2 for a user error). How a failure is reported on one
    process and under a launcher: :mod:`fxpar.cli.failures`."""
    from fxpar.ir.errors import FxparError

    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    if argv[:1] == ["launch"]:
        from fxpar.cli import launch

        return launch.main(argv[1:], commands=_commands(parser))
    with _logging():
        try:
            args = failures.parse_args(parser, argv)
            return args.func(args)
        except FxparError as e:
            return failures.user_error(f"fxpar: {e}", e)
        except Exception as e:
            if not failures.multi_rank():
                raise  # one process: Python's own traceback
            return failures.bug(e)
