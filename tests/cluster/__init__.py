"""Jobs across several hosts: network namespaces with sshd, Slurm and mpirun."""
