"""The strategy of every ParallelDims layout that shards: pipeline stages (pp) x FSDP2 / HSDP (dp) x tensor +
sequence parallel (tp) on one DeviceMesh. ``parallel.strategy=fsdp`` is this with pp = tp = 1, ``3d`` the general
case; only pure replication (``ddp``) and DeepSpeed (``zero``) run other strategies.

Built by ``hpcdist.parallel.parallelize`` in the house order, per pipeline stage of this rank:
split -> TP -> activation checkpointing -> compile -> FSDP2 on the dp mesh (meta) -> materialize. See dims.py for
the rank layout (tp innermost), tp.py for the TP plan and pp.py for stage splitting and micro-batching.

What the train loop sees is the usual Strategy:
- ``forward_backward`` runs the pipeline schedule (or, without pp, the plain micro-batch loop) and returns the
  step's mean loss on every rank: the last stage computes it, one scalar all-reduce over pp hands it to the others.
- ``optimizer_step`` clips by the global gradient norm: DTensor norms cover dp and tp shards, the squared norms
  of the stages are summed over pp.
- ``dcp_state`` / ``load_dcp_state`` use the unsplit model's FQNs (stages keep them), with the optimizer's param
  groups listing every FQN of the whole model, so a checkpoint loads into any (pp, dp, tp) layout, DDP or FSDP.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_model_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from hpcdist.base.logging_utils import get_logger
from hpcdist.models.llama import document_ids
from hpcdist.parallel.base import Strategy, cross_entropy
from hpcdist.parallel.dims import ParallelDims
from hpcdist.parallel.pp import build_schedule

__all__ = ["MeshStrategy", "clean_fqn", "model_view"]

log = get_logger(__name__)

# wrappers that insert a path component between a module and its parameters (activation checkpointing, compile)
_WRAPPER_PREFIX = re.compile(r"(^|\.)(_checkpoint_wrapped_module|_orig_mod)\.")


def clean_fqn(name: str) -> str:
    """FQN as in the unwrapped model: drop the activation-checkpoint and torch.compile wrapper components."""
    return _WRAPPER_PREFIX.sub(r"\1", name)


def model_view(parts: Sequence[nn.Module]) -> nn.Module:
    """One module whose parameters are exactly this rank's, under the unsplit model's FQNs.

    One stage per rank: the stage itself. Several (interleaved schedules): a shell holding the stages' blocks in
    one ``layers`` dict plus the embedding / head of the stages that have them, so one optimizer and one
    ``get_state_dict`` cover them all (the stages stay the modules that run; the shell never runs forward).
    """
    if len(parts) == 1:
        return parts[0]
    blocks = [(k, b) for p in parts for k, b in cast(nn.ModuleDict, p.layers).items()]
    shell = nn.Module()
    shell.layers = nn.ModuleDict(dict(sorted(blocks, key=lambda kv: int(kv[0]))))
    for name in ("tok_embeddings", "norm", "output"):
        owners = [getattr(p, name) for p in parts if getattr(p, name, None) is not None]
        setattr(shell, name, owners[0] if owners else None)
    return shell


class MeshStrategy(Strategy):
    """``parts``: this rank's stage modules (one, or several with an interleaved schedule; the whole model when
    pp == 1). ``model`` / ``module`` is their FQN-faithful view (``model_view``)."""

    def __init__(
        self,
        parts: Sequence[nn.Module],
        *,
        dims: ParallelDims,
        meshes: dict[str, DeviceMesh],
        stage_ids: list[int],
        num_stages: int,
        schedule: str,
        loss_parallel: bool,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        self.parts, self.dims, self.meshes = list(parts), dims, meshes
        self.model = self.module = model_view(parts)
        self.loss_parallel = loss_parallel and dims.tp_enabled
        self.pp_group = meshes["pp"].get_group() if dims.pp_enabled else None
        self.has_first = 0 in stage_ids
        self.has_last = num_stages - 1 in stage_ids
        self._fqn_groups: list[list[str]] | None = None
        self.schedule = None
        stages = "; ".join(
            f"stage {i}: layers {','.join(cast(nn.ModuleDict, p.layers))}"
            for i, p in zip(stage_ids, parts, strict=True)
        )
        pipeline = (
            f", {schedule} over {num_stages} stages, {self.grad_accum} micro-batches/step" if dims.pp_enabled else ""
        )
        log.info("mesh: %s%s (rank 0 holds %s)", dims.describe(), pipeline, stages)
        if dims.pp_enabled:
            assert self.pp_group is not None
            world = meshes["world"]
            self.schedule = build_schedule(
                parts,
                stage_ids,
                num_stages=num_stages,
                schedule=schedule,
                n_microbatches=self.grad_accum,
                loss_fn=cross_entropy,
                device=self.device,
                pp_group=self.pp_group,
                # a received DTensor activation is rebuilt on the sub-mesh of the same name (the tp mesh)
                get_mesh=lambda names, layout: world[names],
            )
        self._attach_optimizer(self.model)

    # ------------------------------------------------------------------------------------------ train
    def _loss_context(self) -> contextlib.AbstractContextManager[Any]:
        # vocabulary-sharded logits: cross entropy (and its backward) on the shards; must wrap backward too
        return loss_parallel() if self.loss_parallel else contextlib.nullcontext()

    def _sync_context(self, is_last: bool) -> contextlib.AbstractContextManager[Any]:
        # no pp: gradient accumulation keeps unreduced gradients until the last micro-batch (as fsdp.py)
        for part in self.parts:
            if isinstance(part, FSDPModule):
                part.set_requires_gradient_sync(is_last)
        return contextlib.nullcontext()

    def _train_mode(self, training: bool) -> None:
        for part in self.parts:
            if part.training != training:
                part.train(training)

    @staticmethod
    def _scalar(t: torch.Tensor) -> torch.Tensor:
        # under loss parallel the loss is a replicated DTensor: every tp rank holds the whole value
        return (t.to_local() if isinstance(t, DTensor) else t).detach()

    def forward_backward(self, batch: torch.Tensor) -> torch.Tensor:
        """This dp replica's mean loss over its share of the global batch, the same on all its pp and tp ranks."""
        self._train_mode(True)
        if self.schedule is None:
            total = torch.zeros((), device=self.device)
            for i, (inputs, targets) in enumerate(self._micro_batches(batch)):
                with self._sync_context(i == self.grad_accum - 1), self._autocast(), self._loss_context():
                    loss = cross_entropy(self.model(inputs), targets) / self.grad_accum
                    self._backward(loss)
                total += self._scalar(loss)
            return total
        return self._pipeline(batch, train=True)

    def _pipeline(self, batch: torch.Tensor, *, train: bool) -> torch.Tensor:
        assert self.schedule is not None
        batch = batch.to(self.device, non_blocking=True)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        args = (inputs,) if self.has_first else ()  # other stages receive activations from their predecessor
        target = targets if self.has_last else None
        # document masking: later stages see hidden states, not token ids; every rank holds the batch, so each
        # computes the document ids and the schedule hands them, cut into micro-batches, to every stage as a kwarg
        eos = getattr(self.parts[0], "document_eos", None)
        kwargs = {"doc_ids": document_ids(inputs, eos)} if eos is not None else {}
        losses: list[torch.Tensor] = []
        with self._autocast(), self._loss_context():
            if train:
                self.schedule.step(*args, target=target, losses=losses, **kwargs)
            else:
                self.schedule.eval(*args, target=target, losses=losses, **kwargs)
        # micro-batches are equal-sized, so the mean of their means is the batch mean (as the dp path's sum / n)
        loss = torch.stack([self._scalar(x) for x in losses]).mean() if self.has_last else torch.zeros(())
        loss = loss.to(self.device, torch.float32)
        dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=self.pp_group)  # only the last stage's rank adds a value
        return loss

    def optimizer_step(self, *, skip_nonfinite: bool = False) -> torch.Tensor:
        """Clip by the global norm over every stage and shard, step, advance the schedule. Returns the norm
        (``skip_nonfinite``: see Strategy.optimizer_step)."""
        if self._params is None:
            self._params = [p for p in self.model.parameters() if p.requires_grad]
        self._unscale()
        grads = [p.grad for p in self._params if p.grad is not None]
        # DTensor grads: the per-tensor norms reduce over the dp and tp shards of each stage
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        if self.pp_group is not None:  # stages hold disjoint parameters: add squared norms
            squared = norm.float() ** 2
            dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=self.pp_group)
            norm = squared.sqrt()
        self._update(norm.detach(), skip_nonfinite)  # clips with the global norm unless it skips the step
        return norm.detach()

    @torch.no_grad()
    def sample_losses(self, batch: torch.Tensor) -> torch.Tensor | None:
        """Collective here (every rank calls it, in lock step: the dp ranks' batches have equal rows): FSDP and TP
        forwards gather shards. None with a pipeline, whose schedule needs its micro-batch count."""
        if self.schedule is not None:
            return None
        losses = []
        for row in batch.to(self.device):
            with self._autocast(), self._loss_context():
                losses.append(self._scalar(cross_entropy(self.model(row[None, :-1]), row[None, 1:])).float())
        return torch.stack(losses)

    @torch.no_grad()
    def eval_loss(self, batch: torch.Tensor) -> torch.Tensor:
        self._train_mode(False)
        if self.schedule is not None:
            return self.global_mean(self._pipeline(batch, train=False))
        total, n = torch.zeros((), device=self.device), 0
        for inputs, targets in self._micro_batches(batch):
            with self._autocast(), self._loss_context():
                total += self._scalar(cross_entropy(self.model(inputs), targets))
            n += 1
        return self.global_mean(total / max(n, 1))

    # ------------------------------------------------------------------------------------------ replicas
    def replica_group(self) -> dist.ProcessGroup | None:
        # dp shards parameters (FSDP); only HSDP's replicate dimension holds identical copies
        return self.meshes["dp_replicate"].get_group() if self.dims.hsdp_enabled else None

    def has_replicas(self) -> bool:
        return self.dims.hsdp_enabled

    # ------------------------------------------------------------------------------------------ checkpoint
    def _full_param_groups(self) -> list[list[str]]:
        """The FQNs of each optimizer param group over the whole model (every stage), the same on all ranks."""
        if self._fqn_groups is None:
            names = {id(p): clean_fqn(n) for n, p in self.module.named_parameters()}
            local = [[names[id(p)] for p in g["params"]] for g in self.optimizer.param_groups]
            gathered: list[Any] = [local]
            if dist.is_initialized() and dist.get_world_size() > 1:
                gathered = [None] * dist.get_world_size()
                dist.all_gather_object(gathered, local)  # once: the parameter set never changes
            merged: list[list[str]] = [[] for _ in local]
            for rank_groups in gathered:
                for i, fqns in enumerate(rank_groups):
                    merged[i] += [f for f in fqns if f not in merged[i]]
            self._fqn_groups = merged
        return self._fqn_groups

    def dcp_state(self) -> dict[str, Any]:
        """As the base (unsplit FQNs), but each param group lists the whole model's FQNs, not this stage's: DCP
        keeps one copy of such a non-tensor entry, and loading matches parameters to groups by FQN, so the same
        entry serves every stage of every layout, and DDP / FSDP checkpoints (which list all FQNs) load here."""
        model_sd, optim_sd = get_state_dict(self.module, self.optimizer)
        groups = self._full_param_groups()
        optim_sd["param_groups"] = [
            {**cast(dict, g), "params": list(groups[i])} for i, g in enumerate(cast(list, optim_sd["param_groups"]))
        ]
        return {"model": model_sd, "optim": optim_sd}

    def load_dcp_state(self, state: dict[str, Any]) -> None:
        if "optim" not in state:  # weights-only checkpoint: moments start at zero
            set_model_state_dict(self.module, state["model"])
            return
        set_state_dict(self.module, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
