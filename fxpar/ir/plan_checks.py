"""The checks of :class:`fxpar.ir.plan.Plan` that tie several fields together (each a PlanError naming the
fields, the numbers and the fix). Reads a plan; writes nothing."""

from __future__ import annotations

from fxpar.ir.errors import PlanError


def check_combinations(plan) -> None:
    """The fields that need others: int8 communication, collective matmul, expert parallelism."""
    if plan.comm_dtype not in (None, "int8"):
        raise PlanError(f"Plan.comm_dtype={plan.comm_dtype!r}: use 'int8' or leave it out")
    if plan.comm_dtype is not None and plan.zero != 3:
        raise PlanError(f"Plan.comm_dtype={plan.comm_dtype!r} quantizes ZeRO-3's parameter gathers; "
                        f"zero={plan.zero} has none: use zero=3")
    if plan.base_dtype not in (None, "int8", "nf4"):
        raise PlanError(f"Plan.base_dtype={plan.base_dtype!r}: use 'int8' or 'nf4' (QLoRA's frozen base in 8-bit or "
                        "4-bit NormalFloat blocks) or leave it out")
    if plan.quantize_grads and plan.comm_dtype is None:
        raise PlanError("Plan.quantize_grads=True needs comm_dtype='int8' (and zero=3)")
    if not isinstance(plan.collective_matmul, int) or plan.collective_matmul < 0 \
            or plan.collective_matmul == 1:
        raise PlanError(f"Plan.collective_matmul={plan.collective_matmul!r}: use 0 (off) or a chunk count >= 2")
    if plan.collective_matmul and not plan.sequence_parallel:
        raise PlanError(f"Plan.collective_matmul={plan.collective_matmul} overlaps sequence-parallel "
                        "all-gathers and reduce-scatters with matmuls: set sequence_parallel=True and tp > 1")
    if plan.ep > 1 and plan.tp > 1:
        raise PlanError(f"Plan(ep={plan.ep}, tp={plan.tp}): expert parallelism does not compose with tensor "
                        "parallelism yet (fxpar/passes/expert_parallel.py); use ep with dp and pp, or tp alone")
    if plan.ep > 1 and plan.zero == 3:
        raise PlanError(f"Plan(ep={plan.ep}, zero=3): ZeRO-3 would shard the experts' slices again over dp "
                        "(fxpar/passes/expert_parallel.py does not compose with zero3); use zero=0, 1 or 2")
    if plan.cp > 1:
        _check_cp(plan)
    elif plan.cp_attention != "allgather":
        raise PlanError(f"Plan(cp_attention={plan.cp_attention!r}, cp=1): cp_attention picks how attention "
                        "reads the sequence across context-parallel ranks, and cp=1 has none; set cp > 1, or "
                        "leave cp_attention out")


def _check_cp(plan) -> None:
    """Context parallelism composes with dp, ZeRO (HSDP too), ep, tp and pp; sequence parallelism with it is not
    built yet."""
    if plan.sequence_parallel:
        raise PlanError(f"Plan(cp={plan.cp}, sequence_parallel=True): context parallelism composes with dp, ZeRO, "
                        "HSDP, ep, tp and pp so far, not with sequence parallelism (fxpar/passes/context_parallel.py); "
                        "use cp with tp and sequence_parallel=False, or leave cp out")


def check_hsdp(plan) -> None:
    """``dp_replicate > 1`` (HSDP): a divisor of dp, with ZeRO, without expert parallelism."""
    r, dp = plan.dp_replicate, plan.dp
    if dp % r:
        fits = [d for d in range(2, dp + 1) if dp % d == 0]
        raise PlanError(f"Plan(dp={dp}, dp_replicate={r}): dp_replicate copies of the sharded state need "
                        f"dp_replicate to divide dp (shard groups of dp / dp_replicate ranks); use dp_replicate in "
                        f"{fits or [1]} or a dp that {r} divides")
    if plan.zero == 0:
        raise PlanError(f"Plan(dp={dp}, dp_replicate={r}, zero=0): without ZeRO every dp rank is a replica "
                        "already (nothing is sharded); use zero=1, 2 or 3 with dp_replicate, or leave dp_replicate=1")
    if plan.ep > 1:
        raise PlanError(f"Plan(dp={dp}, dp_replicate={r}, ep={plan.ep}): HSDP does not compose with expert "
                        "parallelism (expert slices reduce over dp, dense parameters over dp x ep); use "
                        "dp_replicate=1 with ep, or ep=1 with dp_replicate")

