"""In-process recovery's opt-in: the rendezvous address a rank is given, read before any process group exists; a
malformed one is one clear refusal."""

from __future__ import annotations

import re

import pytest

from hpcdist.config.loader import ConfigError
from hpcdist.fault.inprocess import SPARE_ENV, STORE_ENV, Rendezvous


def test_no_store_means_in_process_recovery_is_off() -> None:
    assert Rendezvous.from_environ({}) is None


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({STORE_ENV: "node1:29400"}, Rendezvous("node1", 29400, spare=False)),
        ({STORE_ENV: "10.0.0.7:1", SPARE_ENV: "1"}, Rendezvous("10.0.0.7", 1, spare=True)),
        ({STORE_ENV: "[fe80::1]:65535", SPARE_ENV: "0"}, Rendezvous("fe80::1", 65535, spare=False)),
    ],
)
def test_a_store_address_and_the_spare_flag_are_read(environ: dict[str, str], expected: Rendezvous) -> None:
    assert Rendezvous.from_environ(environ) == expected


@pytest.mark.parametrize(
    ("environ", "words"),
    [
        ({STORE_ENV: "node1"}, "expected HOST:PORT"),
        ({STORE_ENV: ":29400"}, "expected HOST:PORT"),
        ({STORE_ENV: "node1:0"}, "port in 1..65535"),
        ({STORE_ENV: "node1:99999"}, "port in 1..65535"),
        ({STORE_ENV: "node1:-3"}, "expected HOST:PORT"),
        ({STORE_ENV: "node1:29400", SPARE_ENV: "yes"}, "expected 1 (a warm spare) or 0"),
        ({SPARE_ENV: "1"}, "a spare needs the store"),
    ],
)
def test_a_malformed_rendezvous_is_refused(environ: dict[str, str], words: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(words)):
        Rendezvous.from_environ(environ)


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["fault.regroup_settle_s=0"], "fault.regroup_settle_s: must be a number of seconds > 0"),
        (["fault.regroup_settle_s=5", "fault.regroup_timeout_s=4"], "fault.regroup_timeout_s: must be a number"),
        (["fault.regroup_timeout_s=nan"], "fault.regroup_timeout_s"),
        (["fault.in_process=true", "fault.spare_nodes=1"], "fault.in_process: needs checkpoint.local.dir"),
        (
            ["fault.in_process=true", "checkpoint.local.dir=/dev/shm/x"],
            "fault.in_process: needs fault.spare_nodes >= 1",
        ),
    ],
)
def test_regroup_bounds_are_checked_with_the_config(overrides: list[str], words: str) -> None:
    from hpcdist import config as config_mod

    with pytest.raises(ConfigError, match=words):
        config_mod.load(None, overrides)
