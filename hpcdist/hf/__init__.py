"""Hugging Face Llama interop: export a hpcdist checkpoint as a ``LlamaForCausalLM`` directory, import one back.

* :mod:`hpcdist.hf.convert`: names and the q/k row permutation (``to_hf_state_dict`` / ``from_hf_state_dict``).
* :mod:`hpcdist.hf.export`: ``hpcdist export`` (streamed from DCP by FQN, any strategy and world size).
* :mod:`hpcdist.hf.import_`: ``hpcdist import`` (a step-0 checkpoint) and ``checkpoint.init_from: HF_DIR``.
* :mod:`hpcdist.hf.source`: reading a checkpoint by FQN, its recorded config and tokenizer (also what
  :func:`hpcdist.inference.load_for_inference` reads a checkpoint or a Hugging Face directory with).
* :mod:`hpcdist.hf.tokenizer`: the run's tokenizer as Hugging Face files (the byte tokenizer included).

The torch-free ``config.json`` <-> ModelArgs mapping and the weights' names and shapes are
:mod:`hpcdist.models.hf_config`; the check of a whole Hugging Face directory before anything of it is used (files,
bounded reads, config.json, headers against it, memory) is :mod:`hpcdist.models.hf_directory`. Both are torch-free
and live under ``models`` because the config checks use them.
Nothing is imported here: ``import hpcdist.hf.export`` loads only what the export needs.
"""
