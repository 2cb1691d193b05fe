"""An emulated cluster on one machine: hosts as network namespaces on ``tc``-shaped links.

* :mod:`.netns`     namespaces, veth pairs, a bridge and ``tbf`` qdiscs (kernel-shaped rate);
* :mod:`.schedule`  ``--schedule`` files: rate/delay changes applied while a job runs;
* :mod:`.run`       the ``launchers/emulated-cluster`` command line;
* :mod:`.pingpong`  the verification program (bandwidth and latency between two hosts).

Latency is injected in mpicomm's own point-to-point layer (:mod:`mpicomm.linkdelay`),
since this kernel has no ``netem``. Run ``python -m mpicomm.emulate --help``.
"""
