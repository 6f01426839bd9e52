"""Controller programs: the loops that drive the worker groups."""
