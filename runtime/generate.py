"""Text generation with a compiled model (``CompiledModel.generate``): greedy and sampled decoding under
any plan, token for token what Hugging Face ``model.generate`` gives on the same weights.

Every rank calls ``generate`` with the same inputs, as it calls ``step`` and ``__call__``. Two paths:

* **KV cache** (:class:`KVCacheRunner`; plans with ``pp = dp = microbatches = 1``, any ``tp``, models whose
  cache is all full-attention layers): the prompt runs once through a prefill program that fills a static
  cache, then each new token through a one-token decode program. Under TP each rank's cache holds only
  its own heads (the tensor-parallel pass's KV-cache rule), written in place, never gathered.
* **Fixed window** (every other plan: pipeline, data parallel): each step runs the inference program on
  one fixed-shape window (prompt + new tokens, right-padded; causal attention hides the padding from
  every earlier position), the next token read at the last real position. Correct, not fast: a whole
  window per token.

Either way one input signature per program (``fxpar.runtime.programs``): nothing is traced per token.
The logits come back whole and identical on every rank, so every rank picks the same token: greedy by
argmax, sampling with a ``torch.Generator`` seeded alike on every rank (``seed``, or one drawn on rank 0
and broadcast). As in HF: left-padded batches take ``attention_mask`` and position ids ``cumsum(mask) -
1`` (0 on padding); ``temperature``, then ``top_k``, then ``top_p`` reshape the distribution; a sequence
that emits an end-of-sequence id is padded from then on, and the loop stops once every sequence has
ended (the result is then shorter than ``prompt + max_new_tokens``). The batch is padded (its last row
repeated) to a multiple of ``microbatches x dp`` and cut back.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from fxpar.ir import meta
from fxpar.ir.errors import PlanError
from fxpar.runtime import dist_calls
from fxpar.runtime.liveness import guard

WHERE = "fxpar.runtime.generate"


def _config_ids(model, name: str) -> list[int]:
    """Token ids the model's generation config (else its config) names for ``name``, as a list."""
    for cfg in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        value = getattr(cfg, name, None)
        if value is not None:
            return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]
    return []


def _check(input_ids, max_new_tokens, attention_mask, temperature, top_k, top_p) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        raise PlanError(f"{WHERE}: input_ids must be an integer tensor (batch, prompt length); got "
                        f"{getattr(input_ids, 'shape', type(input_ids).__name__)}")
    if input_ids.shape[1] == 0:
        raise PlanError(f"{WHERE}: an empty prompt (input_ids of shape {tuple(input_ids.shape)}): give at least "
                        "one token per row, e.g. the tokenizer's bos_token_id")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise PlanError(f"{WHERE}: max_new_tokens={max_new_tokens!r}: give an integer >= 0")
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise PlanError(f"{WHERE}: attention_mask of shape {tuple(attention_mask.shape)} for input_ids of shape "
                        f"{tuple(input_ids.shape)}: give one mask entry per token (1 real, 0 padding)")
    if not temperature > 0:
        raise PlanError(f"{WHERE}: temperature={temperature!r}: give a number > 0 (do_sample=False for greedy)")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise PlanError(f"{WHERE}: top_k={top_k!r}: give an integer >= 1, or None to keep every token")
    if top_p is not None and not 0 < top_p <= 1:
        raise PlanError(f"{WHERE}: top_p={top_p!r}: give a number in (0, 1], or None")


def warp(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Scores for sampling (batch, vocab): divided by ``temperature``, all but the ``top_k`` best set to
    -inf, then all but the smallest set of best tokens whose probability reaches ``top_p`` (the best
    token always stays)."""
    scores = logits.float() / temperature
    if top_k is not None and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        ordered, order = torch.sort(scores, dim=-1, descending=True)
        probs = ordered.softmax(-1)
        drop = probs.cumsum(-1) - probs >= top_p  # the better tokens already reach top_p
        drop[..., 0] = False
        scores = scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return scores


def _generator(seed: int | None) -> torch.Generator:
    """The same generator on every rank: seeded by ``seed``, or by a seed rank 0 draws and broadcasts."""
    if seed is None:
        drawn = torch.randint(0, 2**62, (1,), dtype=torch.long)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist_calls.broadcast(drawn, 0)
        seed = int(drawn.item())
    return torch.Generator().manual_seed(seed)


def _logits(result) -> torch.Tensor:
    return result.logits if hasattr(result, "logits") else result[0]


def window_inputs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, max_new_tokens: int,
                  pad: int, multiple: int) -> dict:
    """The inputs of the one program every decoding step runs: ``input_ids`` right-padded with ``pad`` to
    ``prompt + max_new_tokens - 1`` (the last new token needs no forward of its own), the mask (1 after the
    prompt: causal attention already hides what follows a position), HF's position ids where the model
    takes them, and the batch padded to a multiple of ``multiple`` rows (``microbatches x dp``) by
    repeating its last row. ``fxpar generate`` compiles with these, so generation traces nothing more."""
    batch, prompt = input_ids.shape
    rows = -(-batch // multiple) * multiple
    width = prompt + max(max_new_tokens, 1) - 1
    ids = torch.full((rows, width), pad, dtype=input_ids.dtype)
    mask = torch.ones((rows, width), dtype=torch.long)
    ids[:batch, :prompt] = input_ids.cpu()
    if attention_mask is not None:
        mask[:batch, :prompt] = attention_mask.cpu().long()
    ids[batch:], mask[batch:] = ids[batch - 1], mask[batch - 1]
    kwargs = {"input_ids": ids, "attention_mask": mask}
    takes = set(inspect.signature(model.forward).parameters)
    if "position_ids" in takes:  # as HF generate: positions count real tokens, padding sits at 0
        kwargs["position_ids"] = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    if "use_cache" in takes:
        kwargs["use_cache"] = False
    return kwargs


class KVCacheRunner:
    """Prefill, then one token at a time, through a static KV cache (``fxpar.frontend.cache``).

    The model is traced with a whole-size cache (one program for the prompt, one for a single token); the
    tensor-parallel pass keeps each rank's keys and values to its own heads; this rank allocates only the
    shard each cache input of its program holds (the placeholder's ``val``), once, shared by both
    programs, which update it in place. The logits come out whole on every rank."""

    def __init__(self, compiled, window: dict, cache):
        self.compiled, self.window, self.cache = compiled, window, cache
        self.local: dict[int, torch.Tensor] = {}  # flat input index -> this rank's cache tensor
        self.leaves = {id(t) for t in pytree.tree_leaves(cache)}

    @classmethod
    def make(cls, compiled, window: dict):
        """A runner for this plan and model, or None (pipeline or data parallel, or no static cache)."""
        if compiled.plan.pp > 1 or compiled.dp * compiled.m > 1 or "use_cache" not in window:
            return None
        cache = compiled.build.static_cache(*window["input_ids"].shape)
        return None if cache is None else cls(compiled, window, cache)

    def __call__(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        """The logits of ``ids`` (rows, n), their keys and values written at positions ``start ..``."""
        kwargs = {**self.window, "input_ids": ids, "past_key_values": self.cache, "use_cache": True}
        if "position_ids" in kwargs:
            kwargs["position_ids"] = kwargs["position_ids"][:, start:start + ids.shape[1]]
        compiled = self.compiled
        with torch.enable_grad():  # a first call traces, writing the cache in place (on views of it)
            result, runtime, _ = compiled.programs.get((), kwargs)
        program = result.program
        vals = {n.name: n.meta.get(meta.VAL) for n in program.graph.nodes if n.op == "placeholder"}
        local = {b.index: vals[b.placeholder] for b in program.inputs if b.kind == "user"}
        inputs = []
        for i, v in enumerate(program.flatten_inputs((), kwargs)):
            if isinstance(v, torch.Tensor) and id(v) in self.leaves:
                if i not in self.local:
                    self.local[i] = torch.zeros(local[i].shape, dtype=local[i].dtype, device=compiled.device)
                elif tuple(self.local[i].shape) != tuple(local[i].shape):
                    raise PlanError(f"{WHERE}: KV-cache input {i} is {tuple(local[i].shape)} in one program and "
                                    f"{tuple(self.local[i].shape)} in another", fix="generate(..., cache=False)")
                v = self.local[i]
            inputs.append(v.to(compiled.device) if isinstance(v, torch.Tensor) else v)
        with guard("generating with a KV cache"):
            out = runtime.run([inputs], train=False).outputs[0]
        outs = [out.get(j) for j in range(result.pipeline.num_user_outputs)]
        return _logits(pytree.tree_unflatten(outs, program.out_spec))


@torch.no_grad()
def generate(compiled, input_ids: torch.Tensor, max_new_tokens: int, *, attention_mask: torch.Tensor | None = None,
             do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None,
             top_p: float | None = None, eos_token_id: int | list[int] | None = None,
             pad_token_id: int | None = None, seed: int | None = None, cache: bool | None = None) -> torch.Tensor:
    """``input_ids`` (batch, prompt) followed by up to ``max_new_tokens`` generated tokens (see the module
    docstring); ``eos_token_id`` / ``pad_token_id`` default to the model's generation config. ``cache``:
    None uses the KV cache where the plan and the model allow it, False never, True or a PlanError."""
    _check(input_ids, max_new_tokens, attention_mask, temperature, top_k, top_p)
    if compiled.plan.cp > 1:  # decoding appends one token at a time: no sequence to split
        raise PlanError(f"{WHERE}: Plan(cp={compiled.plan.cp}) splits each sequence over {compiled.plan.cp} ranks, "
                        "which decoding one token at a time cannot use; generate with a compiled model of the same "
                        "weights and a plan without cp (e.g. the same dp, tp and pp), or evaluate the loss under cp")
    model = compiled.model
    eos = ([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)) if eos_token_id is not None \
        else _config_ids(model, "eos_token_id")
    pad = pad_token_id if pad_token_id is not None else (_config_ids(model, "pad_token_id") or eos or [0])[0]
    batch, prompt = input_ids.shape
    out = input_ids.cpu()
    if max_new_tokens == 0:
        return out
    kwargs = window_inputs(model, out, attention_mask, max_new_tokens, pad, compiled.m * compiled.dp)
    ids = kwargs["input_ids"]
    generator = _generator(seed) if do_sample else None
    finished = torch.zeros(batch, dtype=torch.bool)
    eos_ids = torch.tensor(eos, dtype=out.dtype)
    training = model.training
    model.eval()  # a program traced for generation runs without dropout, as HF generate does
    try:
        runner = KVCacheRunner.make(compiled, kwargs) if cache is not False else None
        if cache and runner is None:
            raise PlanError(f"{WHERE}: cache=True, but plan {compiled.plan} or the model has no KV-cache path (it "
                            "needs pp=1, dp=1, one microbatch, and a cache of full-attention layers)",
                            fix="generate(..., cache=None) runs without one where it cannot")
        for step in range(max_new_tokens):
            if runner is None:
                logits = _logits(compiled(**kwargs))[:batch, prompt + step - 1]
            elif step == 0:
                logits = runner(ids[:, :prompt], 0)[:batch, -1]
            else:
                logits = runner(ids[:, prompt + step - 1:prompt + step], prompt + step - 1)[:batch, -1]
            logits = logits.float().cpu()
            if do_sample:
                token = torch.multinomial(warp(logits, temperature, top_k, top_p).softmax(-1), 1,
                                          generator=generator).squeeze(1)
            else:
                token = logits.argmax(-1)
            token = torch.where(finished, torch.full_like(token, pad), token)
            out = torch.cat([out, token[:, None]], dim=1)
            finished |= torch.isin(token, eos_ids)
            if bool(finished.all()) or step + 1 == max_new_tokens:
                break
            ids[:batch, prompt + step] = token
            ids[batch:, prompt + step] = token[-1]
    finally:
        model.train(training)
    return out
