"""hpcdist: train Llama-style language models on SLURM GPU clusters from one YAML config."""

__version__ = "0.1.0"
