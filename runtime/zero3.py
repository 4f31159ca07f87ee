"""ZeRO-3 at run time: regather parameter buckets for backward, and gather shards back into full tensors.

Reads: the buckets ``fxpar.passes.zero3`` made (each a :class:`~fxpar.ir.buckets.FlatBucket` holding
this rank's ``shard`` parameter) and the ``gather_params`` calls of a running forward. Writes: autograd's
saved tensors (handles instead of gathered buckets). :class:`Zero3Gatherer` gathers full tensors one
bucket at a time for reading the full state; nothing holds a full parameter between steps.

ZeRO-3 is owned by two files: the graph rewrite (``passes/zero3.py``) and this one. The gathers'
backward reduce-scatters the gradients, so the optimizer steps the shards directly; no other runtime
part knows ZeRO-3 but the compiled model, which wraps each training forward in a :class:`Zero3Regather`,
and the full-state reader (``fxpar.runtime.state``), which reads through a :class:`Zero3Gatherer`.
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from fxpar.ir.ops import gather_params
from fxpar.runtime import dist_calls
from fxpar.runtime.collectives import observing_param_gathers

__all__ = ["Zero3Gatherer", "Zero3Regather"]


class Zero3Regather:
    """A context for one ZeRO-3 forward: autograd saves a handle for every tensor that lives in a
    gathered bucket, and gathers the bucket again when backward needs it; the gathered forward copy is
    freed after its last forward use. The regathered bucket is kept while backward works through it: one
    bucket of trained parameters and one of frozen ones of each kind (:func:`_kind`) at a time. A layer whose
    frozen weights have trained adapters beside them (LoRA: each kind in buckets of its own, ``passes/zero3.py``)
    reads both in turn in its backward, base then adapter for each projection; holding one bucket in all
    gathered the layer's frozen bucket again at every projection, and held two at each switch.

    ``backward_next``: this forward's backward comes right after it (the pipeline runtime knows from
    its schedule). Then the bucket gathered last is kept from the end of the forward for the backward,
    which starts with it, instead of being gathered again, as FSDP2 keeps its root's parameters: one
    gather fewer per step (the LM head's bucket, usually), for holding that bucket through the rest of
    the forward (the loss), memory the backward's regather would take a moment later anyway.

    It hears of the buckets from ``gather_params`` through :func:`fxpar.runtime.collectives.
    observing_param_gathers` (this context only), and its saved-tensor hooks live as long as the
    autograd graph of that forward does."""

    def __init__(self, backward_next: bool = False):
        self.backward_next = backward_next
        self._last: torch.Tensor | None = None  # the bucket gathered last, while backward_next
        # storage pointer of a gathered bucket -> (weak ref to its storage,
        # (shard, group, dim, dtype, comm_dtype));
        # the weak ref tells a live bucket from a later tensor that happens to reuse a freed bucket's address
        self.buckets: dict[int, tuple] = {}
        self.regathered: dict[tuple, tuple] = {}  # _kind -> (the shard, its regathered bucket)
        self._observing = None
        self._hooks = None

    def __enter__(self) -> Zero3Regather:
        self._observing = observing_param_gathers(self._observe_last if self.backward_next else self._observe)
        self._observing.__enter__()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        try:
            self._hooks.__enter__()
        except BaseException:
            self._observing.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._hooks.__exit__(*exc)
        finally:
            self._observing.__exit__(*exc)
            self._hooks = self._observing = None
        last, self._last = self._last, None
        if last is not None and exc[0] is None:  # backward's first regather, served from the forward's copy
            args = self.buckets[last.untyped_storage().data_ptr()][1]
            self.regathered = {_kind(*args): (args[0], last)}

    def _observe_last(self, out, *rest) -> None:
        self._observe(out, *rest)
        self._last = out

    def _observe(self, out, shard, group, dim, dtype, comm_dtype=None) -> None:
        self.buckets[out.untyped_storage().data_ptr()] = (StorageWeakRef(out.untyped_storage()),
                                                          (shard, group, dim, dtype, comm_dtype))

    def _pack(self, t: torch.Tensor):
        if t.device.type == "meta" or not self.buckets:
            return t
        ptr = t.untyped_storage().data_ptr()
        entry = self.buckets.get(ptr)
        if entry is None:
            return t
        if entry[0].expired():
            del self.buckets[ptr]
            return t
        return ("zero3", ptr, entry[1], t.storage_offset(), tuple(t.shape), t.stride())

    def _unpack(self, saved):
        if not (isinstance(saved, tuple) and saved and saved[0] == "zero3"):
            return saved
        _, _, (shard, group, dim, dtype, comm_dtype), offset, shape, stride = saved
        # known by its shard (a forward bucket's address can be reused by a later bucket; the shard does not
        # change within a backward)
        kind = _kind(shard, group, dim, dtype, comm_dtype)
        held = self.regathered.get(kind)
        if held is None or held[0] is not shard:
            self.regathered.pop(kind, None)  # backward has moved on to another bucket of this kind: free it first
            with torch.no_grad():
                held = self.regathered[kind] = (shard, gather_params(shard.detach(), group, dim, dtype, comm_dtype))
        return held[1].as_strided(shape, stride, offset)


def _kind(shard, group, dim, dtype, comm_dtype) -> tuple:
    """The slot a regathered bucket takes: trained buckets share one; frozen ones one per way of gathering them
    (held dtype, cast, wire format), so a QLoRA layer's int8 codes, their fp32 scales and its norms (three kinds
    under bf16; ``passes/zero3.py`` buckets frozen tensors the same way) are each gathered once per layer."""
    return (False,) if shard.requires_grad else (True, shard.dtype, dtype, comm_dtype)


class Zero3Gatherer:
    """Full tensors of this rank's ZeRO-3 parameters (or their gradients), one bucket at a time: asking for
    a parameter all-gathers its bucket over the data-parallel group ``group_name`` (every dp rank asks in
    the same order) and keeps only that bucket until a parameter of another one is asked for, so reading
    the whole state holds no more than one gathered layer beside what the caller keeps.
    ``buckets``: stage -> its buckets; ``canonical``: a name -> its canonical FQN."""

    def __init__(self, buckets: dict[int, list], canonical, group_name: str, dp: int, grads: bool):
        self.of = {canonical(n): b for stage_buckets in buckets.values() for b in stage_buckets for n in b.names}
        self.canonical, self.group, self.dp, self.grads = canonical, group_name, dp, grads
        self._bucket, self._pieces = None, {}

    def __contains__(self, fqn: str) -> bool:
        return fqn in self.of

    def __getitem__(self, fqn: str) -> torch.Tensor:
        b = self.of[fqn]
        if b is not self._bucket:
            self._bucket, self._pieces = None, {}  # the previous bucket is freed before the next is gathered
            src = b.shard.grad if self.grads else b.shard.detach()
            src = torch.zeros_like(b.shard) if src is None else src
            full = torch.empty(b.shard_numel * self.dp, dtype=src.dtype, device=src.device)
            if self.dp == 1:  # the shard is the bucket (no group to gather over)
                full.copy_(src)
            else:
                dist_calls.all_gather_into(full, src.contiguous(), self.group)
            self._bucket, self._pieces = b, {self.canonical(n): v for n, v in b.unflatten(full).items()}
        return self._pieces[fqn]
