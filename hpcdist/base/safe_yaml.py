"""YAML written by users (job configs, model presets, NCCL profiles, override values), loaded within bounds.

``yaml.safe_load`` runs no code but trusts the document's shape: nine lines of nested aliases ("billion laughs")
describe 9**9 values that share memory until anything walks them (an error message's repr did, and took a 6 GiB
process down), and a second ``train:`` block silently replaces the first. :func:`load_text` refuses both, and files
far larger than any config, before anything walks the data. Imports only PyYAML: config, models and launch use it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, SequenceNode

__all__ = ["MAX_BYTES", "MAX_DEPTH", "MAX_VALUES", "RefusedYAML", "load_file", "load_text"]

# A job config has about a hundred values; the biggest shipped file has a few hundred. These bounds leave room for
# generous hand-written files and stop a document long before it costs memory or time.
MAX_VALUES = 10_000
"""Values (scalars, lists, mappings) the document may describe, each alias counted as the copy it stands for."""
MAX_DEPTH = 64
"""Nesting levels of lists and mappings."""
MAX_BYTES = 1 << 20
"""Size of a YAML file (1 MiB)."""

_MERGE_TAG = "tag:yaml.org,2002:merge"


class RefusedYAML(yaml.MarkedYAMLError):
    """Valid YAML that is refused (duplicate key, alias expansion, nesting, size); ``problem`` says why and how to
    fix it, ``problem_mark`` where (when known)."""


def _expanded_size(node: Node, memo: dict[int, int], depth: int = 0) -> int:
    """Values ``node`` stands for once every alias is copied out, stopping early past MAX_VALUES / MAX_DEPTH.

    Memoized by node identity, so the cost is linear in the document's text, not in its expansion."""
    if depth > MAX_DEPTH:
        raise RefusedYAML(problem=f"nested more than {MAX_DEPTH} levels deep", problem_mark=node.start_mark)
    known = memo.get(id(node))
    if known is not None:
        return known
    memo[id(node)] = MAX_VALUES + 1  # a node that contains itself (&a [*a]) expands forever
    total = 1
    if isinstance(node, SequenceNode):
        children: list[Node] = list(node.value)
    elif isinstance(node, MappingNode):
        children = [n for pair in node.value for n in pair]
    else:
        children = []
    for child in children:
        total += _expanded_size(child, memo, depth + 1)
        if total > MAX_VALUES:
            break
    memo[id(node)] = total
    return total


class _BoundedLoader(yaml.SafeLoader):
    def construct_document(self, node: Node) -> Any:
        if _expanded_size(node, {}) > MAX_VALUES:
            raise RefusedYAML(
                problem=f"its aliases (*name) expand to more than {MAX_VALUES} values; write the values out, or "
                "reuse fewer anchors",
                problem_mark=node.start_mark,
            )
        return super().construct_document(node)

    def construct_mapping(self, node: Node, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, MappingNode):
            self._refuse_duplicate_keys(node)
        return super().construct_mapping(node, deep=deep)

    def _refuse_duplicate_keys(self, node: MappingNode) -> None:
        """A key given twice: YAML keeps the last silently, which drops the first block without a word. Keys that
        ``<<: *base`` merges in may be overridden (that is what the merge is for); only the node's own keys count."""
        first: dict[Any, Node] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG:
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                earlier = first.setdefault(key, key_node)
            except TypeError:  # an unhashable key: SafeConstructor reports it, with its position
                continue
            if earlier is not key_node:
                raise RefusedYAML(
                    problem=f"duplicate key {_truncated(key)!r} (first at line {earlier.start_mark.line + 1}): the "
                    "second would silently replace the first; merge them into one",
                    problem_mark=key_node.start_mark,
                )


def _truncated(value: Any, limit: int = 60) -> str:
    text = str(value)
    return text if len(text) <= limit else f"{text[:limit]}..."


def load_text(text: str) -> Any:
    """One YAML document -> Python values (safe types only); raises yaml.YAMLError, :class:`RefusedYAML` included."""
    try:
        return yaml.load(text, Loader=_BoundedLoader)  # a SafeLoader subclass: safe types only
    except RecursionError:  # PyYAML's composer recurses once per nesting level, before construct_document
        raise RefusedYAML(problem=f"nested more than {MAX_DEPTH} levels deep") from None
    except (ValueError, OverflowError) as e:
        # PyYAML's constructors let these through: a date like 2024-13-45, an int of more than 4,300 digits
        raise yaml.YAMLError(f"a value YAML cannot construct: {str(e)[:200]}") from None


def load_file(path: Path) -> Any:
    """:func:`load_text` of a UTF-8 file no larger than MAX_BYTES; OSError / UnicodeDecodeError as ``read_text``
    raises."""
    size = path.stat().st_size
    if size > MAX_BYTES:
        raise RefusedYAML(problem=f"is {size:,} bytes; a YAML file here is at most {MAX_BYTES:,} (1 MiB)")
    return load_text(path.read_text(encoding="utf-8"))
