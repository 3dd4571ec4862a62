"""The node-local checkpoint tier (:mod:`~hpcdist.checkpoint.local.tier`) and the ring copy of each node's files
to the next node."""
