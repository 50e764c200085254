"""Where a run's parts start: the interface the pipeline's steps use (``interface.py``), the launchers (``local.py``
on this machine, ``kubernetes/`` on a cluster), the one process runner (``process.py``) and the tether of a leased
service (``tether.py``)."""
