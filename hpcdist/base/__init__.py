"""Standard-library leaves any layer of hpcdist may import: atomic writes, ownership and trust checks, safe YAML,
signals, user-facing errors, logging, run-directory names and the bounded reader of records others may have
written. Nothing here imports torch or another part of hpcdist outside this folder."""
