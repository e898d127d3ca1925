"""How the ranks divide the work: joining the process group (`process_group.py`), the run's
parallel dimensions (`dims.py`) and its one registry of process groups (`groups.py`), the
collectives every group's traffic goes through (`comm.py`) with their rank-agreement tags
(`tags.py`), the device mesh of a run with pipeline stages or tensor slices (`mesh.py`), and what
a rank stores of a tensor-parallel slice (`sliced.py`)."""
