"""How the controller and the workers talk: MPI for calls and data, a TCP sideband for liveness."""
