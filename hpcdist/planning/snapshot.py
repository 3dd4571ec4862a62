"""What the node-local tier (``checkpoint.local``) costs a node: the bytes it keeps, how long one snapshot's write
and peer copy take, and whether it fits the node's memory when its directory lies in host memory.

A node holds, per kept step, each of its ranks' state and (with more than one node) the peer node's copy of it;
one step more is being written while the newest stays intact. Every rank also stages its state into host buffers
of its own before the write (the tier's staging, outside the directory). In ``/dev/shm`` all of that is the
node's RAM: Linux sizes that tmpfs at half the RAM unless the site changes it, so a tier larger than that fails at
its first write, hours into a job, unless it is refused before. ``hpcdist plan`` and ``hpcdist train --dry-run``
show it; the dry run refuses a tier that does not fit. A directory on a local disk is shown, never refused: the
disk's size is not known before the job runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpcdist.base.units import size_text
from hpcdist.config.cluster import HardwareConfig
from hpcdist.config.schema import JobConfig
from hpcdist.planning.goodput import LOCAL_WRITE_GBPS

__all__ = ["IN_MEMORY_ROOTS", "SHM_FRACTION", "Footprint", "footprint", "in_host_memory"]

GIB = float(1 << 30)
IN_MEMORY_ROOTS = ("/dev/shm", "/run/shm")  # tmpfs on every Linux distribution: host memory
SHM_FRACTION = 0.5  # tmpfs's default size: half the RAM
# the peer copy's bandwidth where a profile gives no hardware.inter_node_busbw_gbps: one 200 Gb/s link per node
PEER_COPY_GBPS = 25.0


def in_host_memory(directory: str) -> bool:
    """Whether ``directory`` (placeholders unexpanded) lies in a tmpfs that every Linux node mounts in RAM."""
    return any(directory == root or directory.startswith(root + "/") for root in IN_MEMORY_ROOTS)


@dataclass(frozen=True)
class Footprint:
    """The node-local tier on one node: sizes in bytes, times in seconds."""

    per_rank_bytes: float
    ranks_per_node: int
    nodes: int
    keep: int
    in_memory: bool
    host_mem_gib: float | None
    write_s: float
    copy_s: float

    @property
    def copies(self) -> int:
        return 2 if self.nodes > 1 else 1  # its own, and the peer node's

    @property
    def step_bytes(self) -> float:
        return self.per_rank_bytes * self.ranks_per_node * self.copies

    @property
    def dir_bytes(self) -> float:
        """The directory's share at its fullest: ``keep`` steps and the one being written."""
        return self.step_bytes * (self.keep + 1)

    @property
    def staging_bytes(self) -> float:
        return self.per_rank_bytes * self.ranks_per_node

    @property
    def problem(self) -> str | None:
        """Why the tier cannot fit the node's memory; None when it fits or nothing can be said."""
        if not self.in_memory or self.host_mem_gib is None:
            return None
        ram = self.host_mem_gib * GIB
        shm = ram * SHM_FRACTION
        if self.dir_bytes > shm:
            return (
                f"checkpoint.local keeps up to {size_text(self.dir_bytes)} per node in host memory, more than "
                f"/dev/shm's {size_text(shm)} (half of hardware.host_mem_gb={self.host_mem_gib:g} GiB); lower "
                f"checkpoint.local.keep (now {self.keep}) or put checkpoint.local.dir on a local disk"
            )
        if self.dir_bytes + self.staging_bytes > ram:
            return (
                f"checkpoint.local needs {size_text(self.dir_bytes + self.staging_bytes)} of host memory per node "
                f"(the directory and each rank's staging buffers), more than hardware.host_mem_gb="
                f"{self.host_mem_gib:g} GiB; lower checkpoint.local.keep or put checkpoint.local.dir on a local disk"
            )
        return None

    def line(self, directory: str, step_s: float | None = None) -> str:
        """One line for a plan or a dry run: the sizes, the times and the verdict."""
        text = (
            f"node-local checkpoint tier ({directory}): {size_text(self.per_rank_bytes)} per rank per step (fp32 "
            f"weights + AdamW's 2 moments), {size_text(self.step_bytes)} per node per step"
            + (" with the peer node's copy" if self.copies == 2 else " (one node: no peer copies)")
            + f", up to {size_text(self.dir_bytes)} per node (checkpoint.local.keep={self.keep} steps and the one "
            f"being written) + {size_text(self.staging_bytes)} of staging buffers; one snapshot: write "
            f"{self.write_s:.1f} s"
            + (f" + peer copy {self.copy_s:.1f} s" if self.copies == 2 else "")
            + " behind training"
        )
        if step_s:
            busy = self.write_s + self.copy_s
            text += f" ({100 * busy / step_s:.0f}% of a {step_s:.1f} s step: " + (
                "every step is practical)" if busy <= step_s else "an every-step cadence would wait for it)"
            )
        if not self.in_memory:
            return text + "; on a local disk (its size is not known here)"
        if self.host_mem_gib is None:
            return text + "; in host memory, the profile gives no hardware.host_mem_gb: its fit is not checked"
        if self.problem:
            return text + "; in host memory: does NOT fit"
        return text + f"; in host memory: fits in {self.host_mem_gib:g} GiB"


def footprint(
    cfg: JobConfig, hw: HardwareConfig | None, *, per_rank_bytes: float, ranks_per_node: int, nodes: int
) -> Footprint | None:
    """The node-local tier of ``cfg`` on ``nodes`` nodes of ``ranks_per_node`` ranks holding ``per_rank_bytes``
    each (fp32 weights and AdamW's moments as the layout shards them); None without a tier."""
    loc = cfg.checkpoint.local
    if not loc.dir:
        return None
    per_node = per_rank_bytes * ranks_per_node
    peer_gbps = (hw.inter_node_busbw_gbps if hw is not None else None) or PEER_COPY_GBPS
    return Footprint(
        per_rank_bytes=per_rank_bytes,
        ranks_per_node=ranks_per_node,
        nodes=nodes,
        keep=loc.keep,
        in_memory=in_host_memory(loc.dir),
        host_mem_gib=hw.host_mem_gb if hw is not None else None,
        write_s=per_node / (LOCAL_WRITE_GBPS * 1e9),
        copy_s=per_node / (peer_gbps * 1e9) if nodes > 1 else 0.0,
    )
