"""The regroup protocol's bookkeeping on one process and a real TCPStore: who is declared dead, who is evicted, how
many vacancies the spares see, and that a group that cannot form fails within its bound instead of hanging."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from hpcdist.fault.regroup import Evicted, Membership, RegroupFailed, connect, regroup, serve


@pytest.fixture
def store() -> Iterator[dist.TCPStore]:
    server = serve(0, timeout_s=30)
    client = connect("127.0.0.1", server.port, timeout_s=30)
    yield client
    del client, server


def _vacancies(store: dist.Store) -> list[str]:
    count = int(store.add("spare/vacancies", 0))
    return [store.get(f"spare/vacancy/{i}").decode() for i in range(count)]


def test_without_a_spare_regroup_fails_in_bound_and_posts_one_vacancy_per_generation(store: dist.TCPStore) -> None:
    start = time.monotonic()
    with pytest.raises(RegroupFailed, match="no complete group of 2 within 3 s"):
        regroup(store, Membership(0, 2, 0), settle_s=0.1, timeout_s=3, collective_timeout_s=1)
    assert time.monotonic() - start < 10
    assert not dist.is_initialized()
    vacancies = _vacancies(store)
    assert vacancies and vacancies == [f"{n}:1:2" for n in range(1, len(vacancies) + 1)]


def test_a_rank_declared_dead_that_comes_back_is_evicted(store: dist.TCPStore) -> None:
    with pytest.raises(RegroupFailed):
        regroup(store, Membership(0, 2, 0), settle_s=0.1, timeout_s=1, collective_timeout_s=1)
    posted = _vacancies(store)
    with pytest.raises(Evicted, match="rank 1 of generation 1 was given to another process"):
        regroup(store, Membership(1, 2, 0), settle_s=0.1, timeout_s=1)
    assert _vacancies(store) == posted  # the evicted rank posted nothing


def test_a_waiting_spare_leaves_once_the_job_is_marked_done(store: dist.TCPStore) -> None:
    import threading

    from hpcdist.fault.regroup import mark_done, standby

    threading.Timer(0.3, mark_done, args=(store,)).start()
    t0 = time.monotonic()
    assert standby(store, timeout_s=20) is None
    assert time.monotonic() - t0 < 10


def test_a_spare_without_a_vacancy_fails_in_bound(store: dist.TCPStore) -> None:
    from hpcdist.fault.regroup import standby

    t0 = time.monotonic()
    with pytest.raises(RegroupFailed, match=r"no vacancy filled within 0\.5 s"):
        standby(store, timeout_s=0.5)
    assert time.monotonic() - t0 < 5
