"""``fxpar inspect``: trace a model and print its module table, graph, picture or JSON."""

from __future__ import annotations

import json
import sys

from fxpar.train.models import example_kwargs, load_model


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
