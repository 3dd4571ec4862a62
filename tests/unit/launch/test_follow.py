"""`hpcdist logs --follow` / `submit --wait`: a log streamed while it grows, restarted after a requeue, to its end."""

from __future__ import annotations

import io
import threading
from pathlib import Path

from hpcdist.launch.follow import follow


def test_streams_while_written_and_reads_the_end_after_the_job_ended(tmp_path: Path) -> None:
    log = tmp_path / "123_0_log.out"
    ended = threading.Event()
    seen_while_running: list[str] = []
    out = io.StringIO()

    def job() -> None:  # a rank writing its log line by line; the last line lands just before the job ends
        for i in range(5):
            with log.open("a", encoding="utf-8") as f:
                f.write(f"step {i} | tps 5,140 é\n")
            ended.wait(0.02)
        ended.set()

    def sleep(_: float) -> None:
        seen_while_running.append(out.getvalue())
        ended.wait(0.01)

    writer = threading.Thread(target=job)
    writer.start()
    follow(lambda: log if log.exists() else None, ended.is_set, out, sleep=sleep)
    writer.join()
    assert out.getvalue() == "".join(f"step {i} | tps 5,140 é\n" for i in range(5))
    assert any(0 < len(s) < len(out.getvalue()) for s in seen_while_running)  # printed before the end


def test_a_log_started_again_by_a_requeue_is_read_from_its_start(tmp_path: Path) -> None:
    log = tmp_path / "7_0_log.out"
    log.write_text("attempt 1: a long first line\n")
    states = iter([False, False, True])
    out = io.StringIO()

    def sleep(_: float) -> None:
        log.write_text("attempt 2\n")  # SLURM truncates the log when the requeued job starts

    follow(lambda: log, lambda: next(states), out, sleep=sleep)
    text = out.getvalue()
    assert text.startswith("attempt 1: a long first line\n") and text.endswith("from its start:\nattempt 2\n")


def test_nothing_yet_while_pending(tmp_path: Path) -> None:
    out = io.StringIO()
    states = iter([False, True])
    follow(lambda: None, lambda: next(states), out, sleep=lambda _: None)
    assert out.getvalue() == ""
