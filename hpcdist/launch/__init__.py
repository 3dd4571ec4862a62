"""Scheduler-neutral orchestration: submit (submitit executors, the batch script through the scheduler's
Launcher), the attempt loop, the restart policy and requeueing, job records, sweeps, code snapshots, NCCL
profiles and the job side of a task. What a scheduler itself does lives in its package (hpcdist.schedulers).

Imported eagerly (submitit itself is only imported when a job is rendered or submitted): a lazy attribute
could not work here, because importing the submodule ``hpcdist.launch.submit`` rebinds the package attribute
``submit`` to the module unless the package has bound the function first.
"""

from hpcdist.config.cluster import ClusterConfig, load_cluster
from hpcdist.launch.submit import JobHandle, submit

__all__ = ["ClusterConfig", "JobHandle", "load_cluster", "submit"]
