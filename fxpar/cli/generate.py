"""``fxpar generate MODEL --prompt TEXT``: text from a model directory under any plan (torchrun, or one
process).

MODEL is a ``save_pretrained`` directory (what ``fxpar train --export`` writes): config, safetensors
weights (each rank reads only its own shards) and the tokenizer. ``--chat`` renders each prompt as a
user turn with the tokenizer's chat template and its generation prompt; several ``--prompt`` make one
left-padded batch. The model is compiled for the fixed-window inputs
(:func:`fxpar.runtime.generate.window_inputs`): pipeline and data-parallel plans decode every token with
that one program; plans that allow a KV cache (``pp = dp = 1``, any ``tp``) add a prefill and a one-token
decode program on the first call. Rank 0 prints each prompt's continuation.
"""

from __future__ import annotations

import torch

from fxpar.ir.errors import PlanError
from fxpar.ir.schedule import microbatches


def encode_prompts(tok, prompts: list[str], chat: bool) -> dict:
    """The prompts as one left-padded batch (``input_ids``, ``attention_mask``), chat-rendered if asked."""
    if chat:
        if not getattr(tok, "chat_template", None):
            raise PlanError(f"fxpar generate --chat: the tokenizer of {tok.name_or_path} has no chat template",
                            fix="drop --chat to continue the raw text, or save a tokenizer with a chat_template")
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True) for p in prompts]
    tok.padding_side = "left"
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=not chat)  # a template has its own
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


def rows_multiple(plan) -> int:
    """Rows a batch must be a multiple of under ``plan``: microbatches x dp."""
    return microbatches(plan) * plan.dp


def run(args) -> int:
    import fxpar
    from fxpar.data.tokenizer import load_tokenizer
    from fxpar.launch import init_distributed
    from fxpar.runtime.generate import window_inputs
    from fxpar.train.models import directory_weights, load_model, resolve_model

    kind, directory = resolve_model(args.model)  # a directory without config.json, a hub id: named here
    if kind != "directory":
        raise PlanError(f"fxpar generate: {args.model} is a {'zoo name' if kind == 'zoo' else 'config file'}, which "
                        "has neither weights nor a tokenizer", fix="pass what save_pretrained or `fxpar train "
                        "--export DIR` wrote (config.json, safetensors weights, tokenizer)")
    weights = directory_weights(directory)  # checked before any rank communicates
    tok = load_tokenizer(directory)
    batch = encode_prompts(tok, args.prompt or [""], args.chat)
    if batch["input_ids"].shape[1] == 0 and tok.bos_token_id is not None:
        batch = {"input_ids": torch.full((len(batch["input_ids"]), 1), tok.bos_token_id),
                 "attention_mask": torch.ones((len(batch["input_ids"]), 1), dtype=torch.long)}
    plan = fxpar.Plan.from_file(args.plan_file) if args.plan_file else fxpar.Plan.parse(args.plan)
    rank, _, device = init_distributed()
    model = load_model(str(directory)).eval()
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    example = window_inputs(model, batch["input_ids"], batch["attention_mask"], args.max_new_tokens, pad,
                            rows_multiple(plan))
    compiled = fxpar.compile(model, plan, example_kwargs=example, device=device, weights=weights)
    out = compiled.generate(batch["input_ids"], args.max_new_tokens, attention_mask=batch["attention_mask"],
                            do_sample=args.do_sample, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, pad_token_id=pad)
    if rank == 0:
        prompt = batch["input_ids"].shape[1]
        for row in out[:, prompt:]:
            print(tok.decode(row, skip_special_tokens=True), flush=True)
    return 0


def add_arguments(p) -> None:
    p.add_argument("model", help="a save_pretrained model directory (config.json, safetensors, tokenizer)")
    p.add_argument("--plan", default="dp=1", help="e.g. tp=2, pp=2, dp=2,tp=2")
    p.add_argument("--plan-file", default=None, help="a JSON or TOML plan")
    p.add_argument("--prompt", action="append", help="text to continue (repeat it for a batch)")
    p.add_argument("--chat", action="store_true", help="render each prompt as a user turn of the chat template")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None, help="sampling seed (the same tokens on every rank)")
