"""Models in and out: source checkpoints (``checkpoint.py``, ``gguf.py``), compiled artifacts
(``artifact.py``, ``summary.py``), the one entry that loads either (``load.py``), atomic writes
(``atomic.py``) and the types they share (``types.py``)."""
