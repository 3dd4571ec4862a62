"""Checkpoints, both tiers: the shared tier's save protocol and resume (:mod:`~hpcdist.checkpoint.manager`), the
node-local tier with its peer copies (:mod:`~hpcdist.checkpoint.local`), and the pieces they share.

Users import from the submodules. This ``__init__`` imports nothing, so a torch-free caller (config, the report,
``hpcdist status``) can read the checkpoint names without loading torch.
"""
