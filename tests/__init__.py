"""rabit2's tests, by what they need to run.

``unit/``: pure checks of one module at a time, in milliseconds.  ``sim/``: many agents in
one process over the seeded in-memory network (:mod:`tests.sim.simnet`), fault plans
included.  ``integration/``: real processes and real sockets on this host.  ``cluster/``:
several hosts (network namespaces, sshd, Slurm, mpirun).  ``support/``: what the folders
share.
"""
