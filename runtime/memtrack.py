"""Peak memory of this process during a region of code (a training step).

The planner predicts what a rank holds at its fullest: parameters, gradients, optimizer states, the
activations kept for backward, communication buffers. On the CPU there is no allocator statistic to ask (the
CUDA caching allocator's ``max_memory_allocated`` has no CPU twin), so three measures are here:

* :class:`AllocatorPeak`: the allocator's own running total, through the torch profiler's memory events. It
  changes nothing about how kernels allocate, so it is the one a prediction is compared with (the benches
  and anything that reports a measured peak use it).
* :class:`RssPeak`: the process's peak resident size above its size on entry (Linux ``VmHWM``, reset through
  ``/proc/self/clear_refs``). Perturbs nothing either, but holds everything the process touches (gloo's
  buffers, Python objects, the libraries' scratch): a cross-check, from above.
* :class:`PeakMemory`: a ``TorchDispatchMode`` that counts tensor storages by identity, exact about which
  storage is counted (views once, a baseline set of tensors, storages outside the allocator such as
  memory-mapped files). Being a dispatch mode, it changes what some backward kernels allocate (see its
  docstring): keep it for tests of storage accounting, never for a step's peak.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import time
import weakref
from collections.abc import Iterable

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

__all__ = ["AllocatorPeak", "PeakMemory", "RssPeak", "live_tensors", "storage_bytes", "trim_heap"]


def _storage(t: torch.Tensor, device: str | None):
    """The untyped storage of ``t`` if it has one on a counted device (never meta), else None. A wrapper
    subclass (DTensor) reports a storage of its global size that holds nothing: its inner tensors are
    counted, not it."""
    if is_traceable_wrapper_subclass(t):
        return None
    try:
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):  # sparse, wrapper subclasses without storage
        return None
    kind = st.device.type
    if kind == "meta" or (device is not None and kind != device):
        return None
    return st


def trim_heap(min_free: int = 0, collect: bool = False) -> None:
    """Give the C heap's free pages back to the operating system (glibc's ``malloc_trim``; a no-op
    elsewhere), where the main heap holds at least ``min_free`` free bytes (``mallinfo2``). glibc returns
    freed memory below its dynamic mmap threshold only when the top of the heap is free, so a CPU process
    keeps its high-water mark: compiling frees far more than it keeps (traces, loaded slices, a taken
    model's tensors), and a training step's activations and gathered buckets are freed at its end.
    Measured on a 168M Llama at dp=4 ZeRO-3 on 4 CPU ranks (bench/memory_vs_peers.py): about 35 MB per rank
    after compile, 370 MB after a step, for 30-65 ms against a 9 s step. ``collect``: run the garbage
    collector first (what reference cycles hold; a full collection takes about 0.2 s in a process with
    torch and transformers loaded, so neither compile nor a step asks for it)."""
    libc = _libc()
    if libc is None:
        return
    if min_free:
        info = getattr(libc, "mallinfo2", None)
        if info is not None:
            info.restype = _MallInfo2
            if info().fordblks < min_free:
                return
    if collect:
        gc.collect()
    libc.malloc_trim(0)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


@functools.lru_cache(maxsize=1)
def _libc():
    """The C library if it is glibc (has ``malloc_trim``), else None."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return libc if libc is not None and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def live_tensors() -> list[torch.Tensor]:
    """Every ``torch.Tensor`` object alive in this process (parameters, gradients, optimizer states,
    buffers, the batch...), as the garbage collector sees them."""
    tensor = torch.Tensor  # the exact type test: some module objects warn when asked their __class__
    return [o for o in gc.get_objects() if issubclass(type(o), tensor)]


def storage_bytes(tensors: Iterable[torch.Tensor], device: str | None = None) -> int:
    """Bytes of the distinct storages under ``tensors`` (views of one storage counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        st = _storage(t, device) if isinstance(t, torch.Tensor) else None
        if st is not None:
            seen[st._cdata] = st.nbytes()
    return sum(seen.values())


class PeakMemory(TorchDispatchMode):
    """``with PeakMemory() as mem: fn()`` then ``mem.peak`` (bytes): the most storage bytes alive at once.

    It counts tensor storages itself:

    * on entry, every storage alive in the process (found through ``gc`` over ``torch.Tensor`` objects), or
      only those of a given ``baseline`` set of tensors, each counted once however many tensors view it;
    * inside, a ``TorchDispatchMode`` notes the storage of every tensor an aten op takes or returns (new
      outputs, ``out=`` and in-place results, tensors made outside the dispatcher the first time an op
      uses them), with its current size (a storage resized in place is counted at its new size);
    * a storage stops counting when it is freed (a ``weakref.finalize`` on its Python object, which torch
      keeps alive as long as the storage itself).

    ``peak`` is the largest sum of live storage bytes at any moment an op finished. Not counted: the scratch
    memory inside one aten kernel, buffers a collective backend keeps outside tensors (gloo's), meta
    tensors, storages alive on entry but outside ``baseline``. It costs tens of microseconds per op.

    **It perturbs what it measures**: torch's backward formulas that work in place take an out-of-place
    path while any Python dispatch mode is active (a no-op one included: ``at::isTensorSubclassLike`` is
    true then), so some backward steps allocate a tensor they would otherwise reuse: a gather's backward
    makes its gradient buffer twice (``scatter_add`` for ``scatter_add_``), a vocabulary-parallel loss's
    backward holds one more logits-sized tensor. Measured on ``bench/fused_cross_entropy.py`` (2026-11-27,
    tp=2, 4096 tokens, vocabulary 32768): the unfused step rises 784.2 MiB by :class:`AllocatorPeak` (784.1
    by RSS) and 1,040.1 MiB under a dispatch mode, one [4096, 16384] fp32 tensor more (the fused path, the
    tp=1 path and fxpar's Llama steps at dp, ZeRO-3 and pp: the same by both); fxpar's tp=2 Llama step in
    ``bench/planner_accuracy.py``, 4-5 MiB more of 126 MiB. Keep it for what its exactness is for (which
    storages compile or loading keep, views and memory-mapped slices counted once); measure a step's peak
    with :class:`AllocatorPeak`.

    Args:
        baseline: the tensors whose storages count from the start (None: every tensor alive on entry).
            Storages alive on entry and not in it are ignored for good, even when ops use them.
        exclude: tensors left out of the default baseline (ignored for good as well).
        device: count storages on this device type only ("cpu", "cuda"); None: every device but meta.

    Attributes after the region: ``start`` (bytes live on entry), ``peak``, ``end`` (live on exit),
    ``peak_held`` / ``peak_new``: at the peak, the bytes of storages alive on entry / made inside.
    """

    def __init__(self, baseline: Iterable[torch.Tensor] | None = None, *, exclude: Iterable[torch.Tensor] = (),
                 device: str | None = None):
        super().__init__()
        self._baseline = None if baseline is None else list(baseline)
        self._exclude = list(exclude)
        self.device = device
        self.start = self.peak = self.end = self.current = 0
        self.peak_held = self.peak_new = 0

    # ---- bookkeeping ------------------------------------------------------------------------------
    def _reset(self) -> None:
        self._live: dict[int, tuple[int, bool]] = {}  # storage key -> (bytes, alive on entry)
        self._ignored: set[int] = set()
        self._finalizers: dict[int, weakref.finalize] = {}
        self.current = self._held = 0

    def _watch(self, key: int, st) -> None:
        self._finalizers[key] = weakref.finalize(st, self._freed, key)

    def _freed(self, key: int) -> None:
        self._finalizers.pop(key, None)
        self._ignored.discard(key)
        entry = self._live.pop(key, None)
        if entry is not None:
            self.current -= entry[0]
            if entry[1]:
                self._held -= entry[0]

    def _note(self, t: torch.Tensor, held: bool = False) -> None:
        st = _storage(t, self.device)
        if st is None:
            return
        key = st._cdata
        if key in self._ignored:
            return
        n = st.nbytes()
        entry = self._live.get(key)
        if entry is None:
            self._watch(key, st)
            entry = (0, held)
        if entry[0] != n:
            self.current += n - entry[0]
            if entry[1]:
                self._held += n - entry[0]
            self._live[key] = (n, entry[1])
        if self.current > self.peak:
            self.peak, self.peak_held = self.current, self._held
            self.peak_new = self.current - self._held

    def _ignore(self, t: torch.Tensor) -> None:
        st = _storage(t, self.device)
        if st is not None and st._cdata not in self._ignored and st._cdata not in self._live:
            self._ignored.add(st._cdata)
            self._watch(st._cdata, st)

    # ---- the mode ---------------------------------------------------------------------------------
    def __enter__(self):
        self._reset()
        self.peak = self.peak_held = self.peak_new = 0
        for t in self._exclude:
            self._ignore(t)
        everything = live_tensors()
        for t in (everything if self._baseline is None else self._baseline):
            self._note(t, held=True)
            if self._baseline is None and t.is_leaf and t.requires_grad and t.grad is not None:
                self._note(t.grad, held=True)  # a gradient autograd made may have no Python object yet
        if self._baseline is not None:
            for t in everything:
                self._ignore(t)
        del everything
        self.start = self.current
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        self.end = self.current
        for f in list(self._finalizers.values()):
            f.detach()
        self._reset()
        self.current = self.end
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves((args, kwargs, out)):
            if isinstance(t, torch.Tensor):
                self._note(t)
        return out

    def report(self) -> dict[str, int]:
        """Bytes: ``start``, ``peak``, ``end``; ``peak_held`` / ``peak_new`` split the peak into storages
        alive on entry and storages made inside the region."""
        return {"start": self.start, "peak": self.peak, "end": self.end, "peak_held": self.peak_held,
                "peak_new": self.peak_new}


class AllocatorPeak:
    """The peak of a region measured by the allocator itself, through the torch profiler's memory events,
    which change nothing about how kernels allocate (unlike :class:`PeakMemory`), so this is the one to
    compare a prediction with::

        with AllocatorPeak() as mem:
            compiled.step(**batch)  # a warm-up step: the blocks it allocates become known
            mem.mark()              # the measured region starts here
            compiled.step(**batch)
        mem.peak

    The profiler reports the free of a block only if it saw the block allocated, so the region must come
    after a warm-up under the same profiler: the tensors a step frees (the last step's gradients, buffers
    kept from step to step) are then known. ``start``: the bytes of tensor storage alive at :meth:`mark`
    (:func:`storage_bytes` over :func:`live_tensors` and the gradients of leaf tensors, as
    :class:`PeakMemory` counts on entry); ``peak``: ``start`` plus the highest the allocator's running total
    rose above its value at the mark (every allocation and free of this thread, scratch buffers inside
    kernels included); ``end``: ``start`` plus the net change. Not counted: other threads' allocations
    (gloo's), memory outside torch's allocator (memory-mapped files)."""

    def __init__(self):
        self.start = self.peak = self.end = 0
        self._mark: int | None = None
        self._events: list[tuple[int, int, int, int]] = []  # (time, running total above the mark, size, address)

    def __enter__(self) -> AllocatorPeak:
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        return self

    def mark(self) -> None:
        """Start the measured region (after a warm-up inside this context)."""
        gc.collect()
        everything = live_tensors()
        grads = [t.grad for t in everything if t.is_leaf and t.requires_grad and t.grad is not None]
        self.start = storage_bytes(everything + grads)
        del everything, grads
        self._mark = time.time_ns()  # the profiler stamps its events with the wall clock

    def __exit__(self, *exc):
        self._prof.__exit__(*exc)
        if self._mark is None:
            raise RuntimeError("AllocatorPeak: call mark() after a warm-up step, before the measured one")
        stack = list(self._prof.profiler.kineto_results.experimental_event_tree())
        events = []
        while stack:
            node = stack.pop()
            stack.extend(node.children)
            f = node.extra_fields
            if getattr(f, "total_allocated", None) is not None:
                events.append((node.start_time_ns, f.total_allocated, f.alloc_size, f.ptr))
        events.sort()
        before = [e for e in events if e[0] < self._mark]
        base = before[-1][1] if before else (events[0][1] - events[0][2] if events else 0)
        self._events = [(t, total - base, size, ptr) for t, total, size, ptr in events if t >= self._mark]
        self.peak = self.start + max([0, *(e[1] for e in self._events)])
        self.end = self.start + (self._events[-1][1] if self._events else 0)
        self._prof = None
        return False

    def peak_without(self, tensors: Iterable[torch.Tensor]) -> int:
        """``peak`` with the blocks of ``tensors`` (alive at the region's end, made inside it: the gradients
        a step returns) left out from their allocation on; ``start`` is not changed."""
        ptrs = {t.untyped_storage().data_ptr() for t in tensors}
        last: dict[int, int] = {}  # address -> index of the allocation still alive at the end
        for i, (_, _, size, ptr) in enumerate(self._events):
            if ptr in ptrs:
                if size > 0:
                    last[ptr] = i
                else:
                    last.pop(ptr, None)
        dropped, highest, kept = 0, 0, set(last.values())
        for i, (_, total, size, _) in enumerate(self._events):
            if i in kept:
                dropped += size
            highest = max(highest, total - dropped)
        return self.start + highest

    def report(self) -> dict[str, int]:
        return {"start": self.start, "peak": self.peak, "end": self.end}


class RssPeak:
    """The process's peak resident size during a region, above its resident size on entry (Linux:
    ``/proc/self/status``'s ``VmHWM`` after writing 5 to ``/proc/self/clear_refs``)::

        with RssPeak() as rss:
            compiled.step(**batch)
        rss.peak, rss.end  # bytes above the resident size on entry

    On entry the C heap's free pages go back to the system first (:func:`trim_heap`), else a region could
    reuse pages glibc kept from earlier and never raise the resident size. It counts all the process
    touches (every thread's buffers, Python objects, libraries' scratch) and nothing allocated but never
    written: a cross-check of :class:`AllocatorPeak` from above, perturbing nothing."""

    def __init__(self):
        self.start = self.peak = self.end = 0

    @staticmethod
    def status(key: str) -> int:
        """``key`` (``VmRSS``, ``VmHWM``) of ``/proc/self/status``, in bytes."""
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
        raise KeyError(f"{key} is not in /proc/self/status")

    def __enter__(self) -> RssPeak:
        gc.collect()
        trim_heap()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the resident size now
        self.start = self.status("VmRSS")
        return self

    def __exit__(self, *exc):
        self.peak = self.status("VmHWM") - self.start
        self.end = self.status("VmRSS") - self.start
        return False
