"""Processes and faults: ``fxpar.compile`` joins the process group torchrun describes, and a rank killed
with SIGKILL in the middle of a step makes every other rank exit non-zero within the timeout, with a
message naming the dead rank (fxpar.runtime.liveness).

The rank program is this file run as a script (``python test_faults.py rank``): it never calls
``init_process_group``. The fault test starts it on 4 processes with the variables torchrun would set
but without torchrun's agent (which would itself kill the survivors and hide what fxpar does).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

HERE = os.path.abspath(__file__)
TIMEOUT = 20  # FXPAR_TIMEOUT of the ranks: how long a rank may wait for a peer
PLAN = "dp=2,pp=2,microbatches=2,schedule=1f1b"
STEPS, KILL_STEP = 5, 2


def _train(plan: str, steps: int, kill_rank: int = -1, losses_out: str = "") -> None:
    """The rank program: compile the tiny Llama for ``plan`` (joining the group itself) and train,
    printing each step's loss (rank 0 also writes them to ``losses_out``); rank ``kill_rank`` SIGKILLs
    itself inside its stage's forward of the second microbatch of step ``KILL_STEP``."""
    import atexit

    import torch

    import fxpar
    from fxpar import zoo

    if losses_out:  # registered before compile joins the group: runs after fxpar's exit hook left it
        atexit.register(_record_threads_left, losses_out + f".threads{os.environ.get('RANK', '0')}")
    torch.manual_seed(0)
    model = zoo.build("llama", seed=0)
    batch = zoo.example_inputs("llama", model, batch=8, seq=16)
    compiled = fxpar.compile(model, plan, example_kwargs=batch,
                             optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    print(f"rank {compiled.rank}: compiled on {compiled.device}", flush=True)
    step, forwards = [0], [0]

    def die_mid_step(module, args):
        if step[0] == KILL_STEP:
            forwards[0] += 1
            if forwards[0] == 2:
                print(f"rank {compiled.rank}: SIGKILL in step {step[0]}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

    if compiled.rank == kill_rank:
        for stage in compiled.pipeline.stages_of(compiled.pp_rank):
            stage.gm.register_forward_pre_hook(die_mid_step)
    losses = []
    for step[0] in range(steps):
        losses.append(compiled.step(**batch).item())
        print(f"rank {compiled.rank} step {step[0]} loss {losses[-1]!r}", flush=True)
    if losses_out and compiled.rank == 0:
        with open(losses_out, "w") as f:
            f.write("\n".join(map(repr, losses)))


def _record_threads_left(path: str) -> None:
    """Write the names of this process's threads other than the main one (after the group is gone there
    should be none: gloo's threads still running at exit abort a process now and then)."""
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    with open(path, "w") as f:
        f.write(" ".join(sorted(n for n in names if n != "python")))


def _reference_losses(steps: int) -> list[float]:
    import torch

    from fxpar import zoo

    torch.manual_seed(0)
    model = zoo.build("llama", seed=0)
    batch = zoo.example_inputs("llama", model, batch=8, seq=16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", FXPAR_TIMEOUT=str(TIMEOUT), PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    if os.path.exists("/sys/class/net/lo"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def test_only_failed_waits_on_peers_are_diagnosed():
    """A gloo error, also wrapped in fxpar's CollectiveError or PipelineError, is a failed wait on a peer
    (diagnosed: which rank is gone); a shape error raised before communicating is not."""
    from fxpar.ir.errors import CollectiveError, PipelineError
    from fxpar.runtime.liveness import _is_communication_failure

    gloo = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:22703")
    for outer in (CollectiveError("the collective failed", op="all_reduce", group="dp:0,2"),
                  PipelineError("pipeline rank 0 failed waiting for act from pipeline rank 1")):
        outer.__cause__ = gloo
        assert _is_communication_failure(outer)
    assert _is_communication_failure(gloo)
    assert not _is_communication_failure(CollectiveError("dim 2 is out of range", op="all_gather", group="tp"))
    assert not _is_communication_failure(ValueError("bad input"))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_compile_joins_the_group_under_torchrun(tmp_path):
    """A script that never calls init_process_group, under torchrun --nproc_per_node 2 with pp=2: compile
    joins the group (before, check_world said the world has 1) and the losses equal one process's; at
    exit, fxpar's hook has destroyed the groups and joined gloo's threads (threads left running aborted a
    rank after a run that succeeded, now and then)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           HERE, "rank", "pp=2,microbatches=2", "3", "-1", str(tmp_path / "losses")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=110, env=_env())
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    got = [float(x) for x in (tmp_path / "losses").read_text().split()]  # (both ranks share torchrun's stdout)
    want = _reference_losses(3)
    print("torchrun pp=2:", got, "\none process:  ", want)
    assert len(got) == 3 and max(abs(a - b) for a, b in zip(got, want)) < 1e-5
    if os.path.isdir("/proc/self/task"):
        left = {r: (tmp_path / f"losses.threads{r}").read_text() for r in (0, 1)}
        assert left == {0: "", 1: ""}, f"threads still running after fxpar's exit hook: {left}"


@pytest.mark.slow
@pytest.mark.serial  # a wall-clock bound: alone, after the parallel pass (under its load a rank exited 30.7 s late)
@pytest.mark.timeout(180)
@pytest.mark.parametrize("victim", [1, 0])
def test_sigkilled_rank_is_named_by_every_other_rank(tmp_path, victim):
    """4 ranks (dp=2 x pp=2) train; rank ``victim`` SIGKILLs itself in the middle of step 2 (rank 0 also
    hosts the rendezvous store). Every other rank must exit non-zero within FXPAR_TIMEOUT of the death,
    saying which rank is gone, and none may hang."""
    port, world = _free_port(), 4
    procs, logs = [], []
    try:
        for rank in range(world):
            log = open(tmp_path / f"rank{rank}.log", "w+")
            env = _env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=world)
            procs.append(subprocess.Popen([sys.executable, HERE, "rank", PLAN, str(STEPS), str(victim)],
                                          stdout=log, stderr=subprocess.STDOUT, env=env))
            logs.append(log)
        deadline = time.monotonic() + 110  # start, compile and two steps (slow on a loaded machine)
        while procs[victim].poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        died = time.monotonic()
        assert procs[victim].returncode == -signal.SIGKILL, f"rank {victim} did not die: {_read(logs[victim])}"
        exits = {}
        for rank, p in enumerate(procs):
            if rank == victim:
                continue
            try:
                p.wait(timeout=max(0.1, died + TIMEOUT + 20 - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"rank {rank} still runs {TIMEOUT + 20} s after rank {victim} died:\n{_read(logs[rank])}")
            exits[rank] = time.monotonic() - died
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    print(f"rank {victim} killed; the others exited after (s): " + ", ".join(f"rank {r}: {t:.1f}"
                                                                         for r, t in sorted(exits.items())))
    for rank, seconds in exits.items():
        text = _read(logs[rank])
        assert procs[rank].returncode != 0, text[-3000:]
        # 10 s for the diagnosis and the exit itself: on a loaded 2-core host (2026-11-29) rank 0 exited 28.6 s
        # after the death (3-9 s when quiet); a rank that hangs fails the wait above, 20 s past the timeout
        assert seconds < TIMEOUT + 10, (rank, seconds)
        named = f"rank {victim} is gone" if victim else "rank 0, unless torchrun's agent hosts the store"
        assert "PeerFailure" in text and (named in text or f"rank {victim} is gone" in text), text[-3000:]
        assert f"rank {rank} step {KILL_STEP}" not in text  # the step in which the peer died never finishes
        print(f"rank {rank}:", next(line for line in text.splitlines() if "PeerFailure: " in line))
    for log in logs:
        log.close()


def _read(log) -> str:
    log.flush()
    log.seek(0)
    return log.read()


if __name__ == "__main__" and sys.argv[1:2] == ["rank"]:
    _train(sys.argv[2], int(sys.argv[3]), *([int(sys.argv[4])] + sys.argv[5:6] if len(sys.argv) > 4 else []))
