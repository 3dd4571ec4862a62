"""A rank SIGKILLed mid-run, survived in-process: 3 gloo ranks, a rendezvous store in a process of its own and one
warm spare, all fork-started. Rank 1 kills itself at step 3; ranks 0 and 2 leave the failed all_reduce, regroup on
the next generation, the spare becomes rank 1, and every step's all_reduce result (step 3 redone) is exactly the sum
of the three ranks' inputs, as in a run that nobody interrupted."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import signal
import time
import traceback
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hpcdist.fault.regroup import Membership, agree_resume_step, connect, join_group, regroup, serve, standby

pytestmark = pytest.mark.dist

WORLD = 3
STEPS = 8
KILLED_RANK = 1
KILL_STEP = 3
WAIT_S = 60  # bounds every store wait and every group formation in the test


def _inputs(rank: int, step: int) -> torch.Tensor:
    # integer-valued float64: any summation order gives the same bits, so the expected sum is exact
    return torch.arange(8, dtype=torch.float64) * (rank + 1) + 100 * step + rank


def _expected(step: int) -> torch.Tensor:
    return sum((_inputs(r, step) for r in range(WORLD)), torch.zeros(8, dtype=torch.float64))


def _serve_store(conn: Any, stop: Any) -> None:
    store = serve(0, timeout_s=WAIT_S)
    conn.send(store.port)
    stop.wait(timeout=300)


def _steps_across_regroup(store: dist.Store, member: Membership, completed: int, recovering: bool) -> dict[str, Any]:
    """Run steps ``completed``..STEPS-1; on a failed all_reduce, regroup and resume at the agreed step."""
    values: dict[int, torch.Tensor] = {}
    recovered_at = None
    while completed < STEPS:
        if member.rank == KILLED_RANK and completed == KILL_STEP and member.generation == 0:
            store.set("test/killed_at", repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        t = _inputs(member.rank, completed)
        try:
            dist.all_reduce(t)
        except RuntimeError:
            member = regroup(store, member, settle_s=1.0, timeout_s=WAIT_S, collective_timeout_s=WAIT_S)
            completed = agree_resume_step(completed)
            recovering = True
            continue
        if recovering:
            recovered_at, recovering = time.time(), False
        values[completed] = t
        completed += 1
    dist.destroy_process_group()
    return {"pid": os.getpid(), "member": member, "values": values, "recovered_at": recovered_at}


def _rank(rank: int, port: int, q: Any) -> None:
    torch.set_num_threads(1)
    try:
        store = connect("127.0.0.1", port, timeout_s=WAIT_S)
        member = join_group(store, rank, WORLD, collective_timeout_s=WAIT_S)
        q.put((f"rank{rank}", "ok", pickle.dumps(_steps_across_regroup(store, member, 0, recovering=False))))
    except BaseException:
        q.put((f"rank{rank}", "error", traceback.format_exc()))


def _fail_to_join_once(store: dist.Store) -> None:
    """A group that never forms, as a spare meets when its first vacancy's generation dies while forming: the
    process carries the scar (torch's group counter) into the group it joins next."""
    with pytest.raises(RuntimeError):
        dist.init_process_group(
            "gloo", store=dist.PrefixStore("doomed", store), rank=0, world_size=2, timeout=datetime.timedelta(seconds=1)
        )
    assert not dist.is_initialized()


def _spare(port: int, q: Any) -> None:
    torch.set_num_threads(1)
    try:
        store = connect("127.0.0.1", port, timeout_s=WAIT_S)
        _fail_to_join_once(store)
        member = standby(store, timeout_s=WAIT_S, collective_timeout_s=WAIT_S)
        assert member is not None, "the job was marked done before the spare was needed"
        completed = agree_resume_step(None)
        q.put(("spare", "ok", pickle.dumps(_steps_across_regroup(store, member, completed, recovering=True))))
    except BaseException:
        q.put(("spare", "error", traceback.format_exc()))


def test_survivors_regroup_in_process_and_the_spare_takes_the_dead_rank() -> None:
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe()
    stop = ctx.Event()
    server = ctx.Process(target=_serve_store, args=(child, stop), daemon=True)
    server.start()
    procs: dict[str, Any] = {}
    try:
        assert parent.poll(WAIT_S), "the store process did not start"
        port = parent.recv()
        q = ctx.Queue()
        procs["spare"] = ctx.Process(target=_spare, args=(port, q), daemon=True)
        procs.update({f"rank{r}": ctx.Process(target=_rank, args=(r, port, q), daemon=True) for r in range(WORLD)})
        for p in procs.values():
            p.start()
        results = {}
        for _ in range(WORLD):  # the survivors and the spare; the killed rank reports nothing
            name, status, value = q.get(timeout=2 * WAIT_S)
            assert status == "ok", f"{name} failed:\n{value}"
            results[name] = pickle.loads(value)
        procs[f"rank{KILLED_RANK}"].join(timeout=WAIT_S)
        assert procs[f"rank{KILLED_RANK}"].exitcode == -signal.SIGKILL
        killed_at = float(connect("127.0.0.1", port, timeout_s=WAIT_S).get("test/killed_at").decode())
    finally:
        for p in procs.values():
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        stop.set()
        server.join(timeout=10)
        if server.is_alive():
            server.kill()

    assert set(results) == {"rank0", "rank2", "spare"}
    for name in ("rank0", "rank2"):  # the survivors are the processes started first, not restarted ones
        assert results[name]["pid"] == procs[name].pid and procs[name].exitcode == 0
        assert results[name]["member"] == Membership(int(name[-1]), WORLD, 1)
    assert results["spare"]["pid"] == procs["spare"].pid
    spare = results["spare"]["member"]
    assert (spare.rank, spare.world_size, spare.generation) == (KILLED_RANK, WORLD, 1)
    # when the recovery began, as the first survivor in the regroup wrote it: after the kill, before the spare joined
    assert spare.started is not None and killed_at <= spare.started <= time.time(), (spare, killed_at)

    for name in ("rank0", "rank2"):
        assert sorted(results[name]["values"]) == list(range(STEPS))
    assert sorted(results["spare"]["values"]) == list(range(KILL_STEP, STEPS))
    for result in results.values():
        for step, value in result["values"].items():
            assert torch.equal(value, _expected(step)), (step, value, _expected(step))

    recovery_s = max(r["recovered_at"] for r in results.values()) - killed_at
    print(f"kill -> next completed all_reduce: {recovery_s:.2f} s (settle_s=1.0)")
