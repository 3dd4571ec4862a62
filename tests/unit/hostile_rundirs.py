"""A generated set of hostile run directories: each is a plausible run dir of job 77 (a ledger, a failure record,
goodput, metrics) with ONE record replaced by what another user or a crash could leave there: a FIFO, a link to a
file outside, a directory, a sparse 1 GiB file, nesting 200,000 levels deep, bytes that are no UTF-8, a file of
another owner (when root can chown), and per record kind the wrong types and values seen in the field, terminal
escapes and forged lines included. Shared by the tests of every reader (status, report, the attempt loop,
after-step, train); not a test module itself.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

JOB = "77"
ESC = "\x1b[2J\x1b[31mred\nFAKE LINE"

# the records a run dir holds (name -> a valid content), written before the one made hostile
BASE: dict[str, str] = {
    "restarts.json": json.dumps(
        {
            "job_id": JOB,
            "attempts": {"0": {"restart": 0, "start": 1.0, "nodes": ["n1"]}},
            "excluded": [],
            "stopped": None,
        }
    ),
    "failures.jsonl": "",
    "goodput.json": json.dumps({"attempts": [{"start": 1.0, "last": 2.0, "train_s": 0.5, "last_step": 3}]}),
    "run_summary.json": json.dumps({"steps": 3, "best_eval_loss": 2.5}),
    "metrics.jsonl": json.dumps({"step": 1, "loss": 3.0, "tokens_seen": 64}) + "\n",
    "ranks.json": json.dumps({"hosts": ["n1"]}),
    "config.yaml": "run:\n  dir: x\n",
    "local_checkpoints.json": json.dumps({"step": 2, "peer_copies": False}),
}
# read only by `status` (a sweep's record): hostile in its own run dirs, absent from the others (a valid one would make
# `status` show the sweep's table instead of the run's records)
SWEEP = json.dumps({"job_id": JOB, "config": "c.yaml", "tasks": [{"job_id": f"{JOB}_0", "run_dir": "/nonexistent"}]})
FILE_KINDS = ("fifo", "link", "directory", "sparse", "deep", "not_utf8", "other_owner")


@dataclass(frozen=True)
class Hostile:
    """One hostile run dir: ``name`` (the record and how it is damaged) and how to make it in a directory."""

    name: str
    record: str
    make: Callable[[Path], None]

    def build(self, root: Path) -> Path:
        run = root / self.name
        run.mkdir(parents=True)
        for name, text in BASE.items():
            if name != self.record:
                (run / name).write_text(text)
        self.make(run / self.record)
        return run


def _write(text: str | bytes) -> Callable[[Path], None]:
    def make(path: Path) -> None:
        path.write_bytes(text.encode() if isinstance(text, str) else text)

    return make


def _file_kind(kind: str, record: str) -> Callable[[Path], None]:
    def make(path: Path) -> None:
        if kind == "fifo":
            os.mkfifo(path)
        elif kind == "link":
            path.symlink_to("/etc/passwd")
        elif kind == "directory":
            path.mkdir()
        elif kind == "sparse":
            with open(path, "wb") as f:
                f.truncate(1 << 30)
        elif kind == "deep":
            path.write_text("[" * 200_000 if not record.endswith(".jsonl") else '{"a":' * 100_000 + "\n")
        elif kind == "not_utf8":
            path.write_bytes(b'{"job_id": "\xff\xfe", "attempts": {}}\n')
        elif kind == "other_owner":
            path.write_text(BASE.get(record, SWEEP) or '{"kind": "exception", "cause": "x"}\n')
            if os.geteuid() == 0:
                os.chown(path, 65534, 65534)

    return make


def _lines(*records: object) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)


_FAIL = {"time": 5.0, "job_id": JOB, "restart": 0, "kind": "exception", "cause": "boom", "signature": "exception: boom"}
_LEDGER = json.loads(BASE["restarts.json"])


def _ledger(**change: object) -> str:
    return json.dumps({**_LEDGER, **change})


def _attempt(**change: object) -> str:
    return _ledger(attempts={"0": {**_LEDGER["attempts"]["0"], **change}})


CONTENT: dict[str, dict[str, str]] = {
    "restarts.json": {
        "key_superscript": _ledger(attempts={"²": {"restart": 2}, "0": {}}),
        "key_5000_digits": _ledger(attempts={"9" * 5000: {}, "0": {}}),
        "key_leading_zero": _ledger(attempts={"00": {"requeued": "time_limit"}}),
        "policy_unknown_key": _ledger(policy={"x": 1}),
        "policy_string_budget": _ledger(
            policy={
                "requeue": True,
                "max_time_limit": 3,
                "max_preemptions": -1,
                "max_failures": "3",
                "max_same_failure": 3,
                "exclude_failed_nodes": True,
                "max_excluded_nodes": 2,
                "exclude_nodes_file": None,
            }
        ),
        "policy_list": _ledger(policy=[1, 2]),
        "stopped_string": _ledger(stopped="yes"),
        "stopped_no_reason": _ledger(stopped={"restart": 0}),
        "requeued_nan": _attempt(requeued=float("nan")),
        "requeued_number": _attempt(requeued=1),
        "requeued_list": _attempt(requeued=["failure"]),
        "restarted_true": _attempt(restarted=True),
        "attempts_list": _ledger(attempts=[5]),
        "attempt_not_object": _ledger(attempts={"0": 5}),
        "excluded_escape": _ledger(excluded=[ESC, 5]),
        "gate_failed_string": _ledger(gate_failed={"n1": "x"}),
        "gate_failed_escape": _ledger(gate_failed={ESC: [ESC]}),
        "nodes_number": _attempt(nodes=5),
        "start_string": _attempt(start="abc"),
        "job_id_number": json.dumps({**_LEDGER, "job_id": 77}),
        "top_list": "[1, 2]",
        "infinity": '{"job_id": "77", "attempts": {"0": {"start": Infinity}}}',
        "huge_float": '{"job_id": "77", "attempts": {"0": {"start": 1e999}}}',
        "huge_int": '{"job_id": "77", "attempts": {"0": {"start": ' + "9" * 5000 + "}}}",
    },
    "failures.jsonl": {
        "line_list": _lines([1]),
        "line_number": _lines(5),
        "no_kind_no_signature": _lines({"time": 5.0, "job_id": JOB, "restart": 0, "cause": "x"}),
        "blame_string": _lines({**_FAIL, "blame": "node1"}),
        "blame_bad_entries": _lines({**_FAIL, "blame": [5, {"host": 5}, {"host": ESC, "rank": "x"}]}),
        "time_string": _lines({**_FAIL, "time": "abc"}, {**_FAIL, "time": 3.0}),
        "cause_escape": _lines({**_FAIL, "cause": ESC, "kind": ESC}),
        "health_escape": _lines({**_FAIL, "kind": "health", "host": ESC, "cause": ESC}),
        "health_host_number": _lines({**_FAIL, "kind": "health", "host": 5, "cause": 5}),
        "torn_tail": _lines(_FAIL) + '{"time": 6.0, "kind": "exce',
        "restart_string": _lines({**_FAIL, "restart": "0"}),
        "cause_list": _lines({**_FAIL, "cause": ["a"], "signature": {"a": 1}}),
    },
    "goodput.json": {
        "attempts_numbers": json.dumps({"attempts": [5]}),
        "string": json.dumps("x"),
        "infinity": '{"attempts": [{"start": Infinity}]}',
        "start_string": json.dumps({"attempts": [{"start": "abc"}]}),
        "fields_wrong": json.dumps(
            {"attempts": [{"start": 1.0, "last_step": "x", "first_step": [1], "train_s": "y", "end": "z"}]}
        ),
        "attempts_object": json.dumps({"attempts": {"0": {}}}),
        "recovery_string": json.dumps({"attempts": [{"start": 1.0, "recovery": "x", "restart": "1"}]}),
    },
    "run_summary.json": {
        "best_string": json.dumps({"best_eval_loss": "x"}),
        "list": "[1]",
        "best_nan": '{"best_eval_loss": NaN}',
        "escape": json.dumps({ESC: ESC}),
    },
    "metrics.jsonl": {
        "loss_string": _lines({"step": 1, "loss": "abc"}),
        "loss_list": _lines({"step": 1, "loss": [1.0]}),
        "line_list": _lines([1, 2]),
        "line_string": _lines("abc", '"abc"'),
        "step_string": _lines({"step": "1", "loss": 1.0}, {"step": 2, "loss": 1.0, "split": 5}),
        "step_huge": _lines({"step": 10**300, "loss": 1.0, "tokens_seen": "x"}),
        "straggler_wrong": _lines({"step": 1, "split": "straggler", "mem_gib_per_rank": ["x", None]}),
    },
    "ranks.json": {
        "hosts_number": json.dumps({"hosts": 5}),
        "hosts_objects": json.dumps({"hosts": [{"a": 1}, ESC]}),
    },
    "sweep.json": {
        "list": "[1]",
        "tasks_number": json.dumps({"job_id": JOB, "config": "c", "tasks": 5}),
        "task_not_object": json.dumps({"job_id": JOB, "config": "c", "tasks": [5, {"job_id": 5}]}),
        "task_escape": json.dumps(
            {"job_id": JOB, "config": ESC, "tasks": [{"job_id": ESC, "run_dir": ESC}, {"job_id": "77_1", "run_dir": 5}]}
        ),
        "no_tasks": json.dumps({"job_id": JOB}),
    },
    "local_checkpoints.json": {
        "step_string": json.dumps({"step": "x", "shared_dir": 5}),
        "shared_dir_fifo": json.dumps({"step": 2, "shared_dir": "/dev/null"}),
    },
}


def hostile_rundirs() -> list[Hostile]:
    """Every hostile run dir: each record x each file kind, then each record's content cases."""
    files = [*BASE, "sweep.json"]
    out = [Hostile(f"{record}-{kind}", record, _file_kind(kind, record)) for record in files for kind in FILE_KINDS]
    for record, cases in CONTENT.items():
        out += [Hostile(f"{record}-{case}", record, _write(text)) for case, text in cases.items()]
    return out


class Hung(Exception):
    """A reader did not return within its time bound."""


@contextmanager
def time_bound(seconds: float) -> Iterator[None]:
    """Raise Hung in this (the main) thread after ``seconds``: a blocking ``open`` of a FIFO is interrupted, since a
    signal handler that raises ends the system call instead of retrying it."""

    def fire(_sig: int, _frame: object) -> None:
        raise Hung(f"no answer within {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def printed_problems(text: str) -> list[str]:
    """What a reader must never print: a traceback, the CLI's "unexpected error", or an escape character."""
    out = []
    if "Traceback" in text:
        out.append("a traceback")
    if "unexpected error" in text:
        out.append('an "unexpected error" line')
    if "\x1b" in text or "FAKE LINE" in text.replace("\\nFAKE LINE", ""):
        out.append("a terminal escape or a forged line")
    return out
