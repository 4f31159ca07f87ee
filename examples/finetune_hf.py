"""Fine-tune a tiny Hugging Face checkpoint on the chat file the repo ships, on 4 CPU ranks.

    torchrun --standalone --nproc_per_node 4 examples/finetune_hf.py                 # dp=2 x tp=2
    torchrun --standalone --nproc_per_node 4 examples/finetune_hf.py --plan pp=2,tp=2,zero=1
    torchrun --standalone --nproc_per_node 4 examples/finetune_hf.py --lora r=16 --out out/tiny-chat-lora

The first run writes the checkpoint to ``out/tiny-chat`` (a Llama-shaped model with a BPE tokenizer
trained on the chat file, saved with ``save_pretrained`` in several safetensors shards: nothing is
downloaded). Then it asks the model a question, fine-tunes it (the same loop as ``fxpar train``:
packed chat windows with the loss on the assistant's tokens, AdamW with weight-decay groups, warm-up +
cosine, clipping, 2-batch accumulation), printing the loss falling and the evaluation perplexity, asks
again, and exports the fine-tuned model (``from_pretrained`` loads it) to ``out/tiny-chat-ft``. With
``--lora r=16`` only LoRA adapters train (PEFT's ``LoraConfig``, ``fxpar train --lora``):
the export is the adapter, which rank 0 then loads with ``PeftModel.from_pretrained`` and asks again.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "examples" / "data"


def ask(run, question: str) -> str:
    """Greedy answer of the compiled model to one chat question (every rank calls it)."""
    tok = run.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    out = run.compiled.generate(ids, max_new_tokens=16, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def peft_answer(base_dir: str, adapter_dir: str, tok, question: str) -> str:
    """Greedy answer of ``PeftModel.from_pretrained(base, adapter_dir)`` (HF generate, one process)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir).eval()
    ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    out = model.generate(input_ids=ids, max_new_tokens=16, do_sample=False, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def main(argv: list[str] | None = None) -> int:
    import torch.distributed as dist

    from fxpar.cli.train import add_arguments
    from fxpar.launch import init_distributed
    from fxpar.testing.hfdir import make_model_dir
    from fxpar.train.loop import FineTune

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plan", default="dp=2,tp=2")
    p.add_argument("--model", default="out/tiny-chat")
    p.add_argument("--out", default="out/tiny-chat-ft")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--question", default="What is the capital of Peru?")
    p.add_argument("--lora", help="r=N: train LoRA adapters of rank N only (fxpar train --lora)")
    p.add_argument("--lora-alpha", help="the adapters' scale is alpha / r (PEFT's default alpha: 8)")
    p.add_argument("--lora-targets", default="all-linear", help="the layers LoRA adapts (PEFT's all-linear: "
                   "every linear layer but the output layer)")
    p.add_argument("--lr", default="3e-3")
    args = p.parse_args(argv)
    rank, world, _ = init_distributed()
    if rank == 0 and not (Path(args.model) / "config.json").is_file():
        make_model_dir(args.model, "llama")
        print(f"wrote a tiny checkpoint with its tokenizer to {args.model}")
    if world > 1:
        dist.barrier()
    train = argparse.ArgumentParser()
    add_arguments(train)
    run = FineTune(train.parse_args([
        args.model, "--plan", args.plan, "--data", str(DATA / "chat_train.jsonl"),
        "--eval-data", str(DATA / "chat_eval.jsonl"), "--eval-every", "40", "--seq", "64", "--batch", "8",
        "--grad-accum", "2", "--steps", str(args.steps), "--lr", args.lr, "--lr-scheduler", "cosine",
        "--warmup", "0.1", "--weight-decay", "0.1", "--max-grad-norm", "1.0", "--log-every", "10",
        "--export", args.out, *(["--lora", args.lora, "--lora-targets", args.lora_targets] if args.lora else []),
        *(["--lora-alpha", args.lora_alpha] if args.lora_alpha else [])]))
    before = ask(run, args.question)
    run.run()
    after = ask(run, args.question)
    if rank == 0:
        print(f"\nQ: {args.question}\nbefore fine-tuning: {before!r}\nafter fine-tuning:  {after!r}")
        if args.lora:
            answer = peft_answer(args.model, args.out, run.tokenizer, args.question)
            print(f"PEFT, the exported adapter on the base: {answer!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
