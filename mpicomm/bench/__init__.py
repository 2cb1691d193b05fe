"""Benchmarks: ``python -m mpicomm.bench <suite>`` under ``mpiexec``.

Each suite prints a table on rank 0 and writes JSON (``--json PATH``). Timings are
medians over repeated runs, and every comparison is a ratio taken in the same run, since
absolute times on a shared machine mean little.
"""
