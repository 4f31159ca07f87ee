"""``fxpar`` / ``python -m fxpar``: the command line.

Examples::

    fxpar inspect llama                         # module table of the built-in tiny Llama
    fxpar inspect llama --graph --module model.layers.0.self_attn
    fxpar inspect path/to/config.json --meta --batch 1 --seq 4096 --depth 2
    fxpar inspect gpt2 --json > gpt2.json       # the same data for machines
    fxpar inspect qwen2 --dot out/qwen2.dot     # DOT picture (and SVG where graphviz is installed)
    fxpar zoo                                   # the built-in tiny models
    fxpar plan llama --plan dp=2,pp=2,tp=2,zero=1 # what a plan does on 8 ranks: stages, collectives, memory
    torchrun --nproc_per_node 8 -m fxpar train llama --plan dp=2,pp=2,tp=2,zero=1 --steps 5
    torchrun --nproc_per_node 2 -m fxpar train config.json --meta --plan pp=2 --data notes.txt \
        --save ckpt --save-every 50 --export out/
    torchrun --nproc_per_node 4 -m fxpar train llama --plan dp=4 --resume ckpt   # load under another plan
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

EPILOG = __doc__.split("Examples::", 1)[1]


def load_model(spec: str, *, meta: bool = False, layers: int | None = None) -> torch.nn.Module:
    """A zoo name (``llama``) or the path of an HF ``config.json``; built from config, no download."""
    from fxpar.testing import zoo

    overrides = {} if layers is None else {"num_hidden_layers": layers}
    device = "meta" if meta else "cpu"
    if spec in zoo.ZOO_NAMES:
        return zoo.build(spec, device=device, **overrides)
    path = Path(spec)
    if not path.is_file():
        raise SystemExit(f"fxpar: {spec!r} is neither a zoo model ({', '.join(zoo.ZOO_NAMES)}) nor a config file")
    import transformers

    data = json.loads(path.read_text())
    model_type = data.pop("model_type", None)
    if model_type is None:
        raise SystemExit(f"fxpar: {path} has no 'model_type'; it must be a Hugging Face config.json")
    data.update(overrides)
    config = transformers.AutoConfig.for_model(model_type, **data)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return model.train()


def example_kwargs(model: torch.nn.Module, batch: int, seq: int) -> dict:
    from fxpar.testing import zoo

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    name = model_type if model_type in zoo.ZOO_NAMES else None
    if name is not None:
        return zoo.example_inputs(name, model, batch=batch, seq=seq)
    vocab = model.config.vocab_size
    device = next(model.parameters()).device
    ids = torch.randint(0, vocab, (batch, seq), device="cpu").to(device)
    return {"input_ids": ids, "labels": ids, "use_cache": False}


def cmd_inspect(args) -> int:
    import fxpar

    model = load_model(args.model, meta=args.meta, layers=args.layers)
    kwargs = example_kwargs(model, args.batch, args.seq)
    program = fxpar.trace(model, example_kwargs=kwargs, frontend=args.frontend)
    report = fxpar.inspect(program, module=args.module, depth=None if args.depth < 0 else args.depth,
                           picture=args.dot, quiet=True)
    if args.json:
        data = report.to_dict()
        if args.graph:
            data["graph"] = report.graph().splitlines()
        json.dump(data, sys.stdout, indent=2)
        print()
        return 0
    print(report.to_text())
    if args.graph:
        print()
        print(report.graph())
    for pic in report.pictures:
        print(f"wrote {pic}")
    return 0


def cmd_zoo(args) -> int:
    from fxpar.testing import zoo

    for name in zoo.ZOO_NAMES:
        print(f"{name:12s} {zoo.model_kind(name)}")
    return 0


def cmd_train(args) -> int:
    from fxpar.train import run

    return run(args)


def cmd_plan(args) -> int:
    """Compile on one process standing for rank 0 of the plan's world (torch's fake process group:
    collectives do nothing), then print the plan's stage table, collectives and memory per rank."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import fxpar

    plan = fxpar.Plan.from_file(args.plan_file) if args.plan_file else fxpar.Plan.parse(args.plan)
    model = load_model(args.model, meta=args.meta)
    kwargs = example_kwargs(model, args.batch, args.seq)
    dist.init_process_group("fake", rank=0, world_size=plan.world_size, store=FakeStore())
    try:
        compiled = fxpar.compile(model, plan, example_kwargs=kwargs,
                                 optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
        print(f"plan {plan.to_dict()} on {plan.world_size} ranks, mesh {compiled.mesh}; rank 0 shown")
        print(fxpar.inspect(compiled, quiet=True).to_text())
    finally:
        dist.destroy_process_group()
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
    p.set_defaults(func=cmd_inspect)
    z = sub.add_parser("zoo", help="list the built-in tiny models")
    z.set_defaults(func=cmd_zoo)
    from fxpar.train import add_arguments

    t = sub.add_parser("train", help="train under torchrun (see examples below)", epilog="examples:" + EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(t)
    t.set_defaults(func=cmd_train)
    q = sub.add_parser("plan", help="what a plan does (stages, collectives, memory) without launching",
                       epilog="examples:" + EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    q.add_argument("model")
    q.add_argument("--plan", default="dp=1")
    q.add_argument("--plan-file", default=None)
    q.add_argument("--batch", type=int, default=8)
    q.add_argument("--seq", type=int, default=32)
    q.add_argument("--meta", action="store_true")
    q.set_defaults(func=cmd_plan)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from fxpar.ir.errors import FxparError

    try:
        return args.func(args)
    except FxparError as e:
        print(f"fxpar: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
