"""An emulated cluster on one machine: hosts as network namespaces on ``tc``-shaped links.

* :mod:`.netns`     namespaces, veth pairs, a bridge and ``tbf`` qdiscs (kernel-shaped rate);
* :mod:`.schedule`  ``--schedule`` files: rate/delay changes applied while a job runs;
* :mod:`.run`       the ``launchers/emulated-cluster`` command line;
* :mod:`.pingpong`  the verification program (bandwidth and latency between two hosts);
* :mod:`.linkdelay` the emulated link: latency injected before every message of
                    mpicomm's own point-to-point layer (this kernel has no ``netem``), or
                    an alpha-beta link on one machine;
* :mod:`.mpienv`    the MPI installation (``mpiexec``, flavour) and the machine a job runs
                    on.

The bottom layer of mpicomm: it imports only the standard library and mpi4py. Run
``python -m mpicomm.emulate --help``.
"""
