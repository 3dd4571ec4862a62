"""flat_boxes: a flat range of a row-major tensor as N-D boxes (ZeRO's partitions saved by FQN in DCP)."""

from __future__ import annotations

import math

import pytest
import torch

from hpcdist.parallel.zero import flat_boxes


@pytest.mark.parametrize("shape", [(11,), (5, 7), (3, 4, 5), (2, 1, 3, 2)])
def test_every_flat_range_is_covered_in_order_by_few_boxes(shape: tuple[int, ...]) -> None:
    n = math.prod(shape)
    full = torch.arange(n).reshape(shape)
    for start in range(n):
        for stop in range(start, n + 1):
            boxes = flat_boxes(shape, start, stop)
            assert len(boxes) <= 2 * len(shape) - 1
            pos = start
            for offsets, sizes, a, b in boxes:
                assert a == pos and b > a  # consecutive, non-empty, in flat order
                box = full[tuple(slice(o, o + z) for o, z in zip(offsets, sizes, strict=True))]
                assert torch.equal(box.flatten(), torch.arange(a, b)), (shape, start, stop, offsets, sizes)
                pos = b
            assert pos == stop if stop > start else boxes == []
