"""How the ranks divide the work: the collectives every group's traffic goes through (`comm.py`)
and the device mesh of a run with pipeline stages or tensor slices (`mesh.py`)."""
