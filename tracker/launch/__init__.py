"""``rabit2-submit``'s launcher, one module per concept (the entry point is
:mod:`tracker.submit`):

* :mod:`~tracker.launch.options`: :class:`~tracker.launch.options.LaunchOptions`, the
  command line and host files;
* :mod:`~tracker.launch.common`: what every back-end shares: exit statuses, the worker
  environment, whole output lines, the summary;
* :mod:`~tracker.launch.tasks`: one process per task, restarted by this launcher
  (``--cluster local`` and ``ssh``);
* :mod:`~tracker.launch.local`: a worker started here, on its CPUs (``--cluster local``);
* :mod:`~tracker.launch.ssh`: a worker started through ``ssh HOST`` and
  :mod:`tracker.remote` (``--cluster ssh``);
* :mod:`~tracker.launch.group`: one srun or mpirun for every worker, each under
  :mod:`tracker.slot` (``--cluster slurm`` and ``mpi``).
"""
