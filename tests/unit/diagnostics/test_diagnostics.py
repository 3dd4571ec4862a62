"""nccl_check's pure parts: nccl-tests' bandwidth definitions, sizes, result checks, the finder's plans and
scoring, the verdict, the report, the test-only fault switches and the CLI's parsing."""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import pytest
import torch
import yaml

from hpcdist import resources
from hpcdist.diagnostics import collectives, finder, report, verdict
from hpcdist.diagnostics.cli import _without_nproc, build_parser, parse_message_size
from hpcdist.diagnostics.faults import Faults
from hpcdist.diagnostics.watchdog import Hang

# ------------------------------------------------------------------------------------------ bandwidth


@pytest.mark.parametrize("n", [1, 2, 4, 8, 16, 64])
def test_busbw_factors_are_nccl_tests(n: int) -> None:
    """PERFORMANCE.md of nccl-tests: the factor turns algbw into the bandwidth one rank's link carries."""
    assert collectives.busbw_factor("all_reduce", n) == pytest.approx(2 * (n - 1) / n)
    for op in ("reduce_scatter", "all_gather", "all_to_all"):
        assert collectives.busbw_factor(op, n) == pytest.approx((n - 1) / n)
    assert collectives.busbw_factor("broadcast", n) == 1.0
    assert collectives.busbw_factor("sendrecv", n) == 1.0


def test_bandwidths_are_size_over_time_in_gb_per_s() -> None:
    algbw, busbw = collectives.bandwidths("all_reduce", 1 << 30, 0.01, 8)
    assert algbw == pytest.approx((1 << 30) / 0.01 / 1e9)  # 107.37 GB/s
    assert busbw == pytest.approx(algbw * 2 * 7 / 8)
    with pytest.raises(ValueError, match="unknown operation"):
        collectives.busbw_factor("all_gatherv", 4)


def test_message_sizes_double_from_min_to_max() -> None:
    assert collectives.message_sizes(8, 64) == [8, 16, 32, 64]
    assert collectives.message_sizes(8, 100, 4) == [8, 32]
    assert collectives.message_sizes(1 << 10, 64 << 20)[-1] == 64 << 20
    with pytest.raises(ValueError):
        collectives.message_sizes(64, 8)


def test_split_operations_round_sizes_like_nccl_tests() -> None:
    """all_gather/reduce_scatter/all_to_all sizes are multiples of n elements (at least one each); duplicates go."""
    assert collectives.op_sizes("all_gather", [8, 16, 32, 100], 4, 4) == [4, 8, 24]
    assert collectives.op_sizes("all_reduce", [8, 16, 32, 100], 4, 4) == [2, 4, 8, 25]
    assert collectives.op_sizes("broadcast", [1, 2, 8], 4, 4) == [1, 2]


def test_count_wrong_is_exact_unless_the_type_cannot_hold_the_sum() -> None:
    expected = torch.arange(-8, 9, dtype=torch.float32) * 4
    got = expected.clone()
    assert collectives.count_wrong(got, expected, 4) == 0
    got[3] += 1
    got[5] = float("nan")
    assert collectives.count_wrong(got, expected, 4) == 2
    # bf16 holds integers up to 256 exactly; 64 ranks x 8 = 512 does not, so one rounding step is allowed
    big = torch.tensor([509.0, 512.0])
    assert collectives.count_wrong(big.to(torch.bfloat16), big, 64) == 0


def test_every_operation_has_a_case_for_each_placement() -> None:
    assert set(collectives.PLACEMENTS) == set(collectives.OPS)
    assert collectives.PLACEMENTS["all_gather"] == ("out", "in") and collectives.PLACEMENTS["all_reduce"] == ("in",)


# --------------------------------------------------------------------------------------------- finder


@pytest.mark.parametrize("m", range(2, 10))
def test_round_robin_meets_every_pair_once_in_disjoint_rounds(m: int) -> None:
    rounds = finder.round_robin(m)
    pairs = [p for r in rounds for p in r]
    assert sorted(pairs) == list(itertools.combinations(range(m), 2))
    for r in rounds:
        members = [x for p in r for x in p]
        assert len(members) == len(set(members))
    assert len(rounds) == (m - 1 if m % 2 == 0 else m)


def test_plan_measures_one_pair_per_node_then_each_host_pair_both_ways() -> None:
    hosts = ["a", "a", "a", "b", "b", "b"]
    plan = finder.host_plan(hosts)
    rank_steps = [r for r in plan if r.name.startswith("ranks")]
    host_steps = [r for r in plan if r.name.startswith("hosts")]
    assert len(rank_steps) == 3  # 3 pairs per node, one at a time, both nodes at once
    assert all(len(r.transfers) == 4 and {t.mode for t in r.transfers.values()} == {"both"} for r in rank_steps)
    assert [r.name for r in host_steps] == ["hosts round 1a", "hosts round 1b"]
    first = host_steps[0].transfers
    assert {r: (t.peer, t.mode) for r, t in first.items()} == {
        0: (3, "send"),
        1: (4, "send"),
        2: (5, "send"),
        3: (0, "recv"),
        4: (1, "recv"),
        5: (2, "recv"),
    }
    assert finder.host_plan(["solo"]) == []


def test_slow_rank_is_named_and_its_partners_are_not() -> None:
    hosts = ["n1"] * 4
    pair_bw = {p: (0.01 if 2 in p else 1.0) for p in itertools.combinations(range(4), 2)}
    out, scores = finder.rank_outliers(pair_bw, hosts, 0.5)
    assert [o.name for o in out] == ["2"] and scores[2] == 0.01 and scores[0] == 1.0
    assert out[0].ratio == pytest.approx(0.01)
    assert finder.rank_outliers({p: 1.0 for p in itertools.combinations(range(4), 2)}, hosts, 0.5)[0] == []


def test_throttled_host_is_named_by_its_receive_side() -> None:
    # two hosts, the link into b throttled: the only evidence is the direction, which names b (ambiguous)
    out, scores, ambiguous = finder.host_outliers({("a", "b"): 0.01, ("b", "a"): 1.0}, 0.5)
    assert [(o.name, o.kind) for o in out] == [("b", "host")] and ambiguous
    assert scores == {"a": {"rx": 1.0, "tx": 0.01}, "b": {"rx": 0.01, "tx": 1.0}}
    # three hosts, c's uplink is bad: its sends are slow to healthy receivers, so c is named, nobody else
    links = {(s, d): (0.01 if s == "c" else 1.0) for s, d in itertools.permutations("abc", 2)}
    out, _, ambiguous = finder.host_outliers(links, 0.5)
    assert [o.name for o in out] == ["c"] and "sends" in out[0].detail and not ambiguous
    healthy = {(s, d): 1.0 for s, d in itertools.permutations("abcd", 2)}
    assert finder.host_outliers(healthy, 0.5)[0] == []


def test_bandwidths_from_gathered_transfers() -> None:
    # rank 0 and 1 exchanged on host a; rank 0 (a) then sent to rank 2 (b)
    per_rank = [
        [
            {"tag": "rank", "peer": 1, "mode": "both", "seconds": [0.004, 0.002]},
            {"tag": "host a -> b", "peer": 2, "mode": "send", "seconds": [0.001]},
        ],
        [{"tag": "rank", "peer": 0, "mode": "both", "seconds": [0.001, 0.003]}],
        [{"tag": "host a -> b", "peer": 0, "mode": "recv", "seconds": [0.010, 0.005]}],
    ]
    assert finder.rank_pair_bandwidth(per_rank, 1000) == {(0, 1): pytest.approx(1000 / 0.002 / 1e9)}
    assert finder.host_link_bandwidth(per_rank, ["a", "a", "b"], 1000) == {("a", "b"): pytest.approx(2e-4)}
    assert finder.exclude_flag(["n2", "n1", "n2"]) == "--exclude=n1,n2" and finder.exclude_flag([]) is None


# -------------------------------------------------------------------------------------------- verdict


def test_expectations_come_from_the_cluster_profile() -> None:
    hardware = yaml.safe_load(resources.path("cluster", "a100_ib").read_text())["hardware"]
    exp = verdict.load_expectation("a100_ib")
    assert (exp.intra_node_gbps, exp.inter_node_gbps) == (hardware["intra_node_busbw_gbps"], 190)
    assert exp.intra_node_gbps == 230
    assert verdict.load_expectation("a100_ib", inter=100.0, tolerance=0.9).inter_node_gbps == 100.0
    none = verdict.load_expectation("none")
    assert none.intra_node_gbps is None and none.inter_node_gbps is None
    assert verdict.load_expectation("sandbox").intra_node_gbps is None  # a cluster without a hardware block
    with pytest.raises(ValueError, match="no such profile"):
        verdict.load_expectation("a200_ib")


def _table(scope: str, size: int, busbw: float) -> dict:
    return {"op": "all_reduce", "scope": scope, "rows": [{"size": size, "in": {"busbw": busbw}}]}


def test_bandwidth_check_uses_the_largest_size_and_the_tolerance() -> None:
    exp = verdict.Expectation(intra_node_gbps=230, inter_node_gbps=190, tolerance=0.8, source="test")
    big = 1 << 30
    v = verdict.Verdict()
    verdict.bandwidth_checks(v, exp, [_table("intra-node", big, 200.0), _table("inter-node", big, 150.0)])
    assert not v.passed and len(v.reasons) == 1 and "inter-node" in v.reasons[0] and "152.0" in v.reasons[0]
    v = verdict.Verdict()
    verdict.bandwidth_checks(v, exp, [_table("intra-node", 1 << 20, 1.0)])
    assert v.passed and "not checked" in v.notes[0]


def test_verdict_collects_reasons_and_hosts() -> None:
    v = verdict.Verdict()
    v.fail("x", ["n2"])
    v.fail("y", ["n1", "n2"])
    assert not v.passed and v.reasons == ["x", "y"] and v.exclude == ["n1", "n2"]
    assert "suggested for the next job: --exclude=n1,n2" in report.verdict_text(v)


# --------------------------------------------------------------------------------------------- report


def test_report_helpers() -> None:
    assert report.rank_ranges([0, 1, 2, 3, 6, 7, 9]) == "0-3,6-7,9"
    assert report.human_bytes(64 << 20) == "64 MiB" and report.human_bytes(1000) == "1000 B"


def test_sweep_table_has_the_nccl_tests_columns() -> None:
    row = {
        "size": 1024,
        "count": 256,
        "type": "float",
        "redop": "sum",
        "root": -1,
        "in": {"time_us": 10.0, "algbw": 0.1, "busbw": 0.15, "wrong": 0},
    }
    text = report.sweep_text(
        {"op": "all_reduce", "scope": "intra-node", "describe": "4 ranks", "rows": [row], "by_host": {"n1": [row]}}
    )
    lines = text.splitlines()
    assert "out-of-place" in lines[1] and "in-place" in lines[1]
    assert lines[2].split()[1:] == ["size", "count", "type", "redop", "root", *["time", "algbw", "busbw", "#wrong"] * 2]
    assert lines[4].split() == [
        "1024",
        "256",
        "float",
        "sum",
        "-1",
        "N/A",
        "N/A",
        "N/A",
        "N/A",
        "10.0",
        "0.10",
        "0.15",
        "0",
    ]


def test_json_document_keeps_every_number(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    hang = Hang(step="s", timeout_s=5, reporter=0, behind=[{"rank": 2, "host": "n", "last_step": "x"}])
    report.write_json({"links": {("a", "b"): 1.5}, "hang": hang, "inf": float("inf")}, str(out))
    doc = json.loads(out.read_text())
    assert doc["links"] == {"a->b": 1.5} and doc["hang"]["behind"][0]["rank"] == 2 and doc["inf"] is None


def test_hang_lines_name_the_missing_rank() -> None:
    hang = Hang("all_reduce 2 elements in-place", 5, 0, behind=[{"rank": 2, "host": "n1", "last_step": "health"}])
    assert hang.culprit_ranks == [2]
    assert "rank 2 on n1 never arrived (last step: 'health')" in hang.lines()
    inside = Hang("x", 5, 0, inside=[0, 1])
    assert "inside the collective" in inside.lines()[-1] and inside.culprit_ranks == []


# --------------------------------------------------------------------------------------- faults & CLI


def test_fault_switches_are_parsed_in_one_place() -> None:
    env = {
        "HPCDIST_NCCL_CHECK_INJECT_WRONG_RANK": "1",
        "HPCDIST_NCCL_CHECK_DELAY_RANK": "2",
        "HPCDIST_NCCL_CHECK_DELAY_S": "0.5",
        "HPCDIST_NCCL_CHECK_HANG_RANK": "3",
        "HPCDIST_NCCL_CHECK_HANG_AT": "join",
    }
    faults = Faults.from_environ(env)
    assert faults == Faults(wrong_rank=1, delay_rank=2, delay_s=0.5, hang_rank=3, hang_at="join")
    assert len(faults.describe()) == 3 and Faults.from_environ({}).describe() == []
    with pytest.raises(ValueError, match="HANG_AT"):
        Faults.from_environ({"HPCDIST_NCCL_CHECK_HANG_AT": "later"})
    with pytest.raises(ValueError, match="INJECT_WRONG_RANK"):
        Faults.from_environ({"HPCDIST_NCCL_CHECK_INJECT_WRONG_RANK": "one"})
    t = torch.zeros(3)
    faults.corrupt(0, t)
    assert t.sum() == 0
    faults.corrupt(1, t)
    assert t.tolist() == [1.0, 0.0, 0.0]

    def fn() -> int:
        return 7

    assert faults.delayed(0, fn) is fn and faults.delayed(2, fn) is not fn


def test_cli_parsing() -> None:
    assert parse_message_size("8") == 8 and parse_message_size("64K") == 65536
    assert parse_message_size("16MiB") == 16 << 20
    assert parse_message_size("1G") == 1 << 30 and parse_message_size("2kb") == 2048
    with pytest.raises(argparse.ArgumentTypeError):
        parse_message_size("lots")
    args = build_parser().parse_args(["--ops", "all_reduce,sendrecv", "-e", "1M", "--nproc", "4"])
    assert args.ops == ("all_reduce", "sendrecv") and args.max_bytes == 1 << 20 and args.nproc == 4
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--ops", "all_reduce,gather"])
    assert _without_nproc(["--nproc", "4", "-e", "1M", "--nproc=2", "--json", "x"]) == ["-e", "1M", "--json", "x"]
