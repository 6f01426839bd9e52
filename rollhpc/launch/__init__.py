"""From a config to running processes: locally with mpiexec; on Slurm with srun (see slurm/)."""
