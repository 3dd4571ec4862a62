"""Hypothesis strategies for what a user can hand the config loader: YAML documents and ``section.key=value``
overrides, mostly real sections and keys (the deep checks), sometimes anything at all (the error paths)."""

from __future__ import annotations

import dataclasses
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from hpcdist.config import JobConfig

SECTIONS = [f.name for f in dataclasses.fields(JobConfig)]
FIELDS = {s: [f.name for f in dataclasses.fields(type(getattr(JobConfig(), s)))] for s in SECTIONS}

_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63)  # huge ints: test_huge_int_for_a_float_key_is_a_config_error
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
)
_VALUES = st.recursive(
    _SCALARS,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=10,
)
_ALL_KEYS = sorted({k for keys in FIELDS.values() for k in keys})
_KEY_PATHS = [f"{s}.{k}" for s in SECTIONS for k in FIELDS[s]]


def _section_body(name: str) -> st.SearchStrategy[Any]:
    keys = st.sampled_from(FIELDS.get(name, _ALL_KEYS)) | st.text(max_size=8)
    return st.dictionaries(keys, _VALUES, max_size=5) | _VALUES


# mostly real sections with their own keys (deep checks), sometimes anything at all (the error paths)
DOCS = st.lists(st.sampled_from(SECTIONS) | st.text(max_size=8), max_size=4, unique=True).flatmap(
    lambda names: st.fixed_dictionaries({n: _section_body(n) for n in names})
)
_VALUE_TEXT = (
    st.text(max_size=20)
    | st.sampled_from(["null", "~", "true", "no", "[1, 2]", "{a: 1}", "-1", "0", "1e3", ".nan", "-.inf", "'x", "*a"])
    | _SCALARS.map(str)
)
OVERRIDES = st.lists(
    st.text(max_size=30)
    | st.builds(
        lambda k, v: f"{k}={v}",
        st.sampled_from(_KEY_PATHS) | st.builds(lambda s, k: f"{s}.{k}", st.text(max_size=6), st.text(max_size=8)),
        _VALUE_TEXT,
    ),
    max_size=6,
)
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
