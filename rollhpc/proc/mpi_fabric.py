"""A libfabric provider for MPI's start-up alone, not for NCCL's network plugin.

MPICH over srun's pmi2 plugin needs libfabric's ``tcp`` provider (``rollhpc.launch.slurm`` says why), and
MPICH 5 reads the provider only from libfabric's own ``FI_PROVIDER`` (its ``MPIR_CVAR_OFI_USE_PROVIDER``
says "no longer supported in CH4"). Exported to the whole job, FI_PROVIDER=tcp would also hold NCCL's OFI
plugin (aws-ofi-nccl on EFA, Slingshot's cxi) to TCP. So the batch script exports the wish as
``ROLLHPC_MPI_FI_PROVIDER`` and each rank sets FI_PROVIDER only while ``MPI_Init`` runs: the pip ``mpich``
wheel carries its own libfabric, which reads the variable then and never again; NCCL, started later, loads
the system's libfabric and sees the site's environment. A FI_PROVIDER the site set itself is left alone
(then it holds for both). An MPI built against the system's shared libfabric reads it once for the whole
process: there the site's own FI_PROVIDER, set in ``cluster.setup``, is the one that counts.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager

__all__ = ["MPI_FI_PROVIDER", "provider_for_mpi_init"]

MPI_FI_PROVIDER = "ROLLHPC_MPI_FI_PROVIDER"


@contextmanager
def provider_for_mpi_init(environ: MutableMapping[str, str] = os.environ) -> Iterator[str | None]:
    """Within the block (``from mpi4py import MPI``), FI_PROVIDER is ROLLHPC_MPI_FI_PROVIDER unless the
    environment set FI_PROVIDER already; yields the provider MPI starts with (None: libfabric's choice)."""
    wanted = environ.get(MPI_FI_PROVIDER)
    if not wanted or "FI_PROVIDER" in environ:
        yield environ.get("FI_PROVIDER")
        return
    environ["FI_PROVIDER"] = wanted
    try:
        yield wanted
    finally:
        environ.pop("FI_PROVIDER", None)
