"""The run report (`hpcdist report RUN_DIR`): read a run directory's records (rundata, torch-free), draw them
(plots, matplotlib as the optional ``plot`` extra) and write one self-contained HTML page (page)."""
