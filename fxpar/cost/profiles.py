"""Device profiles: what one rank's device computes and moves per second, and how its links carry
collectives (an alpha-beta model per link, or per kind and group size where ``fxpar calibrate`` measured it).

A profile prices a node with a roofline (the larger of its FLOPs over the sustained matmul rate and its bytes
over the memory bandwidth, plus a per-op launch overhead) and a collective with the ring formulas below. The
planner (:mod:`fxpar.planner`) prices whole plans with them, ``fxpar.compile`` balances its pipeline cuts
and predicts stage times with them (:mod:`fxpar.cost.roofline`): one device type everywhere.

Where the figures come from: :data:`PROFILES` holds the published specs of H100 / H200 / A100 times the
sustained efficiencies stated next to them, and a rough default for an uncalibrated CPU host;
``fxpar calibrate`` (:mod:`fxpar.runtime.calibrate`) measures this machine and writes a JSON profile that
:func:`load_profile` reads (by path, ``$FXPAR_PROFILE``, or ``~/.cache/fxpar/profile.json``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from fxpar.cost.comm import KINDS, RING, ring
from fxpar.ir.errors import PlanError
from fxpar.ir.options import run_options

__all__ = ["DEFAULT_PATH", "KINDS", "PROFILES", "DeviceProfile", "Link", "fit_alpha_beta", "fit_table", "load_profile",
           "profile_for_device", "profile_from_measurements"]

# dtype spellings a caller may use -> the profile's keys
_DTYPE_KEYS = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16",
               "float8_e4m3fn": "fp8", "float8_e5m2": "fp8"}
DEFAULT_PATH = Path("~/.cache/fxpar/profile.json")


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s each rank sends per direction (bus bandwidth)
    latency: float  # seconds per message step (alpha)


def _ring_scaled(kind: str, alpha: float, beta: float, measured_n: int, n: int) -> tuple[float, float]:
    """(alpha, beta) measured on ``measured_n`` ranks carried to ``n`` ranks by the ring formula: alpha
    scales with the steps, beta with the share of the bytes each rank sends."""
    s0, b0 = ring(kind, measured_n)
    s1, b1 = ring(kind, n)
    return alpha * s1 / s0, beta * b1 / b0


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    flops: dict[str, float]  # sustained matmul FLOP/s per dtype key ("fp32", "tf32", "bf16", "fp16", "fp8")
    mem_bw: float  # sustained memory bytes/s
    memory: int  # bytes usable per rank
    ranks_per_node: int
    intra: Link  # inside a node
    inter: Link  # between nodes
    op_overhead: float = 0.0  # seconds per launched op
    # busy ranks on a node -> each one's throughput factor
    compute_share: dict[int, float] = field(default_factory=dict)
    collectives: dict[str, dict[int, tuple[float, float]]] = field(default_factory=dict)  # measured (alpha, beta)
    peak_flops: dict[str, float] = field(default_factory=dict)  # published dense peaks, for MFU
    source: str = ""
    # elements/s of non-matmul ops (fxpar counts one FLOP per output element); 0: bandwidth only
    elementwise_rate: float = 0.0
    optimizer_entry_time: float = 0.0  # seconds of the optimizer step per fp32 parameter entry; 0: from mem_bw
    fresh_bw: float = 0.0  # bytes/s of writing into newly mapped memory (first touch); 0: no such cost
    fresh_threshold: int = 0  # outputs of at least this many bytes are newly mapped on every allocation
    # collectives run beside compute (GPU copy engines); False: on the computing cores (gloo on a CPU host)
    comm_overlaps: bool = True
    # torch's optimizers step tensor by tensor on the CPU (temporaries of the largest tensor), with their
    # multi-tensor (foreach) kernels on CUDA (temporaries of every stepped tensor at once)
    optimizer_per_tensor: bool = False
    # fxpar's own per-step costs (fxpar.cost.overheads prices them); 0 or empty: not measured (published GPU profiles)
    # kind -> (s per call, s per byte) of fxpar's op beyond the raw one
    collective_call: dict[str, tuple[float, float]] = field(default_factory=dict)
    # schedule -> s of the runtime's bookkeeping per action of a rank
    pipeline_action: dict[str, float] = field(default_factory=dict)
    # DP bucket: (s per bucket beyond its all-reduce, bytes/s of the gradients' copies in)
    bucket_copy: tuple[float, float] = (0.0, 0.0)
    # ZeRO-3 gather: (s per gather beyond its all-gather, bytes/s of its copies)
    gather_copy: tuple[float, float] = (0.0, 0.0)
    # (s per stepped tensor beyond its entries' time, s per parameter group)
    optimizer_tensor: tuple[float, float] = (0.0, 0.0)
    comm_share: dict[int, float] = field(default_factory=dict)  # busy ranks on a node -> a collective's speed factor
    gather_scratch: float = 0.0  # an all-gather's scratch per output byte (gloo's own all-gather: 1.0; in place: 0)

    def matmul_flops(self, dtype: str) -> float:
        """Sustained matmul FLOP/s for ``dtype`` ("bf16", "float32", a torch.dtype, ...); a dtype the
        profile does not list falls back to fp32 (a CPU host computing bf16 without a measurement)."""
        key = str(dtype).removeprefix("torch.")
        key = _DTYPE_KEYS.get(key, key)
        if key in self.flops:
            return self.flops[key]
        return self.flops.get("fp32", next(iter(self.flops.values())))

    def peak(self, dtype: str) -> float:
        """The published dense peak for ``dtype`` (MFU's denominator); the sustained rate where none is known."""
        key = _DTYPE_KEYS.get(str(dtype).removeprefix("torch."), str(dtype).removeprefix("torch."))
        return self.peak_flops.get(key) or self.matmul_flops(dtype)

    def share(self, busy_ranks_on_node: int) -> float:
        """Each rank's throughput factor when ``busy_ranks_on_node`` ranks compute at once on one node
        (1.0 on a GPU node: a rank per device). Between measured counts the nearest one below holds, its
        node's total throughput spread over the busy ranks."""
        if not self.compute_share or busy_ranks_on_node <= 1:
            return 1.0
        known = sorted(self.compute_share)
        below = [k for k in known if k <= busy_ranks_on_node]
        k = below[-1] if below else known[0]
        factor = self.compute_share[k]
        return factor * k / busy_ranks_on_node if busy_ranks_on_node > k else factor

    def compute_time(self, flops: float, nbytes: float, dtype: str, ops: int = 0, matmul: bool = True) -> float:
        """Roofline seconds of work of ``flops`` and ``nbytes`` of memory traffic, plus ``ops`` launches.
        ``matmul=False``: an elementwise op, a reduction, a copy: its "FLOPs" (one per output element, as
        :mod:`fxpar.cost.flops` counts them) go at the measured ``elementwise_rate`` where there is one (on a
        CPU core exp, rsqrt and softmax are bound by arithmetic, not by memory), else only bytes count."""
        rate = self.matmul_flops(dtype) if matmul else self.elementwise_rate
        work = flops / rate if rate else 0.0
        return max(work, nbytes / self.mem_bw) + ops * self.op_overhead

    def fresh_time(self, nbytes: float) -> float:
        """Seconds of first touch for an op output of ``nbytes``: on a CPU host, allocations of at least
        ``fresh_threshold`` bytes are mapped anew each time (glibc serves them with mmap and unmaps them on
        free) and page-fault on their first write, at ``fresh_bw``; a GPU's caching allocator reuses its
        blocks, so a GPU profile has no such cost."""
        if not self.fresh_bw or nbytes < self.fresh_threshold:
            return 0.0
        return nbytes / self.fresh_bw

    def optimizer_time(self, entries: float, bytes_per_entry: int = 28) -> float:
        """Seconds of one optimizer step over ``entries`` fp32 parameter entries: the measured time per entry
        (``fxpar calibrate`` times torch's AdamW), else a memory-bound pass of ``bytes_per_entry`` (AdamW reads
        the parameter, its gradient and 2 states, writes the parameter and the states: 28 bytes)."""
        if self.optimizer_entry_time:
            return entries * self.optimizer_entry_time
        return entries * bytes_per_entry / self.mem_bw

    def measured(self, kind: str, group: int) -> tuple[float, float] | None:
        """(alpha s, beta s per full-tensor byte) of ``kind`` on ``group`` ranks from the measured table:
        exact where measured; between two measured group sizes interpolated linearly in the group size
        (per ring step and per byte each rank sends, so the ring's shape is kept); outside them carried
        from the nearest measured size by the ring formula. None where the kind was not measured."""
        table = self.collectives.get(kind)
        if not table:
            return None
        if group in table:
            return tuple(table[group])
        sizes = sorted(table)
        lo = [n for n in sizes if n < group]
        hi = [n for n in sizes if n > group]
        if lo and hi:
            a, b = lo[-1], hi[0]
            (aa, ab), (ba, bb) = (_ring_scaled(kind, *table[n], n, group) for n in (a, b))
            w = (group - a) / (b - a)
            return aa + w * (ba - aa), ab + w * (bb - ab)
        nearest = lo[-1] if lo else hi[0]
        return _ring_scaled(kind, *table[nearest], nearest, group)

    def collective_time(self, kind: str, nbytes: int, group: int, inter_node: bool) -> float:
        """Seconds for ``kind`` over ``group`` ranks of a tensor of ``nbytes`` (the FULL tensor, as
        :mod:`fxpar.cost.comm` counts payloads; for ``send`` the bytes sent). Ring formulas on the link
        (``inter`` when the group spans nodes), the steps of alpha and share of the bytes over the
        bandwidth of :data:`fxpar.cost.comm.RING`. A measured table (``collectives``: one host,
        so inside a node) wins for intra-node groups."""
        if group <= 1 or nbytes <= 0:
            return 0.0
        if kind not in RING:
            raise PlanError(f"fxpar.cost.profiles: unknown collective {kind!r}", fix=f"use one of {', '.join(KINDS)}")
        if not inter_node:
            fit = self.measured(kind, group)
            if fit is not None:
                return fit[0] + fit[1] * nbytes
        steps, share = ring(kind, group)
        link = self.inter if inter_node else self.intra
        return steps * link.latency + share * nbytes / link.bandwidth

    def device_model(self, dtype: str = "bf16") -> DeviceProfile:
        """Deprecated (one release): the profile itself; the separate device model it gave is gone."""
        warnings.warn("DeviceProfile.device_model() is deprecated: pass the DeviceProfile itself "
                      "(fxpar.compile(..., profile=...))", DeprecationWarning, stacklevel=2)
        return self

    def to_dict(self) -> dict:
        """Plain JSON-able data (int keys become strings in JSON; :meth:`from_dict` turns them back)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> DeviceProfile:
        """The profile :meth:`to_dict` (or a JSON file of it) describes; keys it does not know (a
        calibration's raw measurements) are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        missing = {"name", "flops", "mem_bw", "memory", "ranks_per_node", "intra", "inter"} - d.keys()
        if missing:
            raise PlanError(f"fxpar.cost.profiles: a device profile needs {', '.join(sorted(missing))}",
                            fix="write profiles with `fxpar calibrate` or DeviceProfile.save")
        kw = {k: v for k, v in d.items() if k in names}
        kw["intra"], kw["inter"] = Link(**d["intra"]), Link(**d["inter"])
        kw["memory"], kw["ranks_per_node"] = int(d["memory"]), int(d["ranks_per_node"])
        kw["collectives"] = {kind: {int(n): (float(a), float(b)) for n, (a, b) in table.items()}
                             for kind, table in d.get("collectives", {}).items()}
        kw["collective_call"] = {k: (float(a), float(b)) for k, (a, b) in d.get("collective_call", {}).items()}
        kw.update({k: {int(n): float(v) for n, v in d.get(k, {}).items()} for k in ("compute_share", "comm_share")})
        kw.update({k: tuple(map(float, d[k])) for k in ("bucket_copy", "gather_copy", "optimizer_tensor") if k in d})
        return cls(**kw)

    def save(self, path, extra: dict | None = None) -> Path:
        """Write the profile as JSON (``extra``: more keys beside it, e.g. raw measurements)."""
        path = Path(path).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**self.to_dict(), **(extra or {})}, indent=1) + "\n")
        return path


# ---- published profiles ---------------------------------------------------------------------------------
# Sustained efficiencies assumed (of the published peaks): dense matmul 0.65 (large GEMMs reach 0.6-0.7),
# HBM 0.8 (a streaming kernel), InfiniBand 0.8 of line rate; NVLink at the all-reduce bus bandwidth NCCL
# reaches (nccl-tests: ~360 GB/s on 8 H100, ~240 GB/s on 8 A100, 0.8 of the 450 / 300 GB/s each way).
# Latency per ring step: 2 us on NVLink (NCCL's small all-reduce on 8 GPUs takes ~15-30 us over its 14
# steps), 8 us over InfiniBand (NIC + NCCL proxy). Usable memory: the capacity the driver reports less 5%
# (CUDA context, NCCL buffers, allocator fragmentation). Op overhead: ~4 us per kernel launch.
MATMUL_EFF, HBM_EFF, IB_EFF, MEM_RESERVE = 0.65, 0.8, 0.8, 0.05
_MIB = 2**20


def _gpu(name: str, peaks_tflops: dict[str, float], hbm_tbs: float, mem_mib: int, nvlink_busbw_gbs: float,
         nic_gbit: float, source: str) -> DeviceProfile:
    peaks = {k: v * 1e12 for k, v in peaks_tflops.items()}
    return DeviceProfile(
        name=name, flops={k: v * MATMUL_EFF for k, v in peaks.items()}, mem_bw=hbm_tbs * 1e12 * HBM_EFF,
        memory=int(mem_mib * _MIB * (1 - MEM_RESERVE)), ranks_per_node=8,
        intra=Link(nvlink_busbw_gbs * 1e9, 2e-6), inter=Link(nic_gbit / 8 * 1e9 * IB_EFF, 8e-6),
        op_overhead=4e-6, peak_flops=peaks, source=source)


# H100 SXM 80GB: 989 TFLOP/s dense bf16/fp16, 494 tf32, 67 fp32 (non-tensor), 1979 fp8; HBM3 3.35 TB/s;
# NVLink 4 900 GB/s total (450 each way), 8 per node; one 400 Gb/s NDR NIC per GPU; the driver reports 81559 MiB.
_H100_PEAKS = {"bf16": 989, "fp16": 989, "tf32": 494, "fp32": 67, "fp8": 1979}
H100 = _gpu("h100-80gb", _H100_PEAKS, 3.35, 81559, 360, 400,
            "published spec: H100 SXM 80GB (989 TFLOP/s bf16, 3.35 TB/s, NVLink 900 GB/s, 400 Gb/s NDR per GPU)")
# H200 141GB: the H100's compute and NVLink, HBM3e 4.8 TB/s, 141 GB (the driver reports 143771 MiB).
H200 = _gpu("h200-141gb", _H100_PEAKS, 4.8, 143771, 360, 400,
            "published spec: H200 141GB (989 TFLOP/s bf16, 4.8 TB/s, NVLink 900 GB/s, 400 Gb/s NDR per GPU)")
# A100 SXM 80GB: 312 TFLOP/s bf16/fp16, 156 tf32, 19.5 fp32; HBM2e 2.0 TB/s; NVLink 3 600 GB/s total
# (300 each way, NCCL busbw ~240); one 200 Gb/s HDR NIC per GPU; the driver reports 81920 MiB.
A100 = _gpu("a100-80gb", {"bf16": 312, "fp16": 312, "tf32": 156, "fp32": 19.5}, 2.0, 81920, 240, 200,
            "published spec: A100 SXM 80GB (312 TFLOP/s bf16, 2.0 TB/s, NVLink 600 GB/s, 200 Gb/s HDR per GPU)")


def _host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * 2**30


def cpu_default(ranks_per_node: int | None = None) -> DeviceProfile:
    """A rough profile of an uncalibrated CPU host, one core per rank (run ``fxpar calibrate`` for real
    figures): ~50 GFLOP/s fp32 per core, ~10 GB/s memory, gloo over loopback ~2 GB/s with ~50 us per
    step, ~10 us eager dispatch per op; ranks beyond the cores share them, and share them with gloo's
    communication (no overlap); 80% of RAM split over the ranks."""
    cores = os.cpu_count() or 1
    n = ranks_per_node or max(8, cores)
    loop = Link(2e9, 50e-6)
    return DeviceProfile(
        name="cpu", flops={"fp32": 50e9}, mem_bw=10e9, memory=int(0.8 * _host_memory() / n), ranks_per_node=n,
        intra=loop, inter=loop, op_overhead=10e-6,
        compute_share={k: min(1.0, cores / k) for k in (1, 2, 4, 8, 16, 32, 64) if k <= max(n, 1)},
        comm_overlaps=False,  # gloo reduces and copies on the cores the ranks compute on
        optimizer_per_tensor=True, gather_scratch=0.0,  # fxpar gathers on gloo by broadcasts, in place
        source=f"rough default for an uncalibrated host ({cores} cores); run `fxpar calibrate`")


PROFILES: dict[str, DeviceProfile] = {p.name: p for p in (H100, H200, A100, cpu_default())}
_ALIASES = {"h100": "h100-80gb", "h200": "h200-141gb", "a100": "a100-80gb"}


def load_profile(spec: str | os.PathLike | DeviceProfile | None = None) -> DeviceProfile:
    """The profile ``spec`` names: a :data:`PROFILES` name (``"h100-80gb"``, ``"h200-141gb"``,
    ``"a100-80gb"``, ``"cpu"``), a JSON path written by ``fxpar calibrate``, or a profile (returned as
    is). None: ``$FXPAR_PROFILE`` if set, else ``~/.cache/fxpar/profile.json`` if it exists, else ``"cpu"``."""
    if isinstance(spec, DeviceProfile):
        return spec
    if spec is None:
        spec = run_options().profile or (str(DEFAULT_PATH) if DEFAULT_PATH.expanduser().exists() else "cpu")
    text = str(spec)
    key = _ALIASES.get(text.lower(), text.lower())
    if key in PROFILES:
        return PROFILES[key]
    path = Path(text).expanduser()
    if path.is_file():
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise PlanError(f"fxpar.cost.profiles: cannot read the device profile {path}: {e}",
                            fix="write it again with `fxpar calibrate --out PATH`") from e
        return DeviceProfile.from_dict(data)
    raise PlanError(f"fxpar.cost.profiles: unknown device profile {text!r} (no such name or file)",
                    fix=f"use one of {', '.join(PROFILES)}, or a JSON file written by `fxpar calibrate --out PATH`")


def _cuda_profile(device) -> DeviceProfile:
    import torch

    name = torch.cuda.get_device_name(device)
    props = torch.cuda.get_device_properties(device)
    usable = int(props.total_memory * (1 - MEM_RESERVE))
    for tag, base in (("H200", H200), ("H100", H100), ("A100", A100)):
        if tag in name.upper():
            return dataclasses.replace(base, memory=usable)
    ratio = props.multi_processor_count / 132  # H100 SXM has 132 SMs
    warnings.warn(f"fxpar: no device profile for {name!r}; using the H100's scaled by its SM count "
                  f"({props.multi_processor_count} / 132); run `fxpar calibrate` for measured figures", stacklevel=3)
    return dataclasses.replace(
        H100, name=f"scaled-h100:{name}", flops={k: v * ratio for k, v in H100.flops.items()},
        peak_flops={k: v * ratio for k, v in H100.peak_flops.items()}, mem_bw=H100.mem_bw * ratio, memory=usable,
        source=f"H100 published spec scaled by SM count for {name}")


def profile_for_device(device) -> DeviceProfile:
    """The profile of the device a process computes on (``torch.device`` or its string): a CUDA device by
    its name (H100 / H200 / A100, with the memory it reports; any other scaled from the H100 with a
    warning), anything else :func:`load_profile` ``(None)`` (the calibrated host, else the rough default)."""
    import torch

    dev = torch.device(device) if not isinstance(device, torch.device) else device
    if dev.type == "cuda" and torch.cuda.is_available():
        return _cuda_profile(dev)
    return load_profile(None)


# ---- a profile from fxpar.runtime.calibrate's measurements --------------------------------------------------

def fit_alpha_beta(points) -> tuple[float, float]:
    """(alpha, beta) of ``t = alpha + beta * bytes`` over ``[(bytes, seconds), ...]``, least squares on the
    relative error (each residual divided by its t, so small messages count as much as large ones); alpha
    is kept >= 0 (refit through the origin otherwise) and beta >= 0."""
    w = [1.0 / max(t, 1e-12) ** 2 for _, t in points]
    sw = sum(w)
    sx = sum(wi * x for wi, (x, _) in zip(w, points))
    sy = sum(wi * t for wi, (_, t) in zip(w, points))
    sxx = sum(wi * x * x for wi, (x, _) in zip(w, points))
    sxy = sum(wi * x * t for wi, (x, t) in zip(w, points))
    det = sw * sxx - sx * sx
    if det > 0:
        beta = (sw * sxy - sx * sy) / det
        alpha = (sy - beta * sx) / sw
        if alpha >= 0 and beta >= 0:
            return alpha, beta
    if sxx > 0 and sxy > 0:
        return 0.0, sxy / sxx
    return sy / sw, 0.0


def fit_table(times: dict) -> dict[str, dict[int, tuple[float, float]]]:
    """{kind: {group size: (alpha, beta)}} fitted to ``{kind: {n: [[bytes, seconds], ...]}}``."""
    return {kind: {int(n): fit_alpha_beta([tuple(p) for p in pts]) for n, pts in table.items() if len(pts) >= 2}
            for kind, table in times.items() if table}


def profile_from_measurements(m: dict, *, name: str | None = None) -> DeviceProfile:
    """The profile :func:`fxpar.runtime.calibrate.calibrate`'s dict describes: measured matmul rates,
    memory bandwidth, op overhead (the forward's per op), compute share and fitted collectives; the
    links from the all-reduce of the largest measured group (per step and per byte each rank sends). A GPU whose
    published profile is known keeps its inter-node link and peaks (one host measures no network), a node being the
    ranks torchrun started on it; a CPU host is one node of ``max(world, cores)`` ranks sharing 80% of its RAM."""
    from fxpar.cost.overheads import runtime_fields  # (fxpar calibrate's "runtime" measurements)
    table = fit_table(m.get("times", {}))
    gpu = str(m.get("device", "cpu")).startswith("cuda")
    base = next((p for tag, p in (("H200", H200), ("H100", H100), ("A100", A100))
                 if gpu and tag in str(m.get("device_name", "")).upper()), None)
    world, cores = int(m.get("world", 1)), int(m.get("cores") or 1)
    ranks = int(m.get("local_world") or world) if gpu else max(world, cores)
    if table.get("all_reduce"):
        n = max(table["all_reduce"])
        alpha, beta = table["all_reduce"][n]
        steps, share = ring("all_reduce", n)
        intra = Link(share / max(beta, 1e-15), alpha / steps)
    else:
        intra = (base or cpu_default()).intra
    memory = (int(m["device_memory"] * (1 - MEM_RESERVE)) if m.get("device_memory")
              else int(0.8 * _host_memory() / ranks))
    return DeviceProfile(
        name=name or f"calibrated-{m.get('host', 'host')}", flops={k: v["flops"] for k, v in m["matmul"].items()},
        mem_bw=m["memory_bandwidth"]["bytes_per_s"], memory=memory, ranks_per_node=ranks, intra=intra,
        inter=base.inter if base else intra, op_overhead=m["op_overhead"]["forward"],
        compute_share={int(k): float(v) for k, v in m.get("compute_share", {}).items()}, collectives=table,
        elementwise_rate=float(m.get("elementwise", {}).get("rate", 0.0)),
        optimizer_entry_time=float(m.get("optimizer", {}).get("seconds_per_entry", 0.0)),
        fresh_bw=float(m.get("fresh", {}).get("bytes_per_s", 0.0)),
        fresh_threshold=int(m.get("fresh", {}).get("threshold", 0)),
        comm_overlaps=gpu,  # gloo reduces and copies on the host's cores, which the ranks compute on
        optimizer_per_tensor=not gpu,
        **runtime_fields(m.get("runtime", {})),
        peak_flops=dict(base.peak_flops) if base else {},
        source=f"calibrated on {m.get('host')} {m.get('date')} ({m.get('backend')}, world {world}"
               f"{', quick' if m.get('quick') else ''}; {m.get('device_name')})")
