"""What the controller and the workers agree on, below both: the Worker base class and what every rank of a role is
given (worker), and each remote method's contract, how a call is split over a role's ranks and its replies collected
(dispatch). Pure logic: no MPI, no torch."""
