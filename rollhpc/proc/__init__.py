"""Process-level helpers every rank and launcher needs, below every other layer: which attempt of a run this is
(attempt), the MPI world's shared memory (mpi_shm), no orphans when a parent dies (parent_death), and garbage
collection paused during start-up (startup_gc)."""
