"""Where every rank goes and what it holds, decided before anything starts: device_mapping (AutoDeviceMapping: roles
onto nodes and GPUs, het groups, colocation, weight-sync routes) and memory_plan (each GPU's memory, stage by
stage). Below launch, controller and workers, which all read the plan; above config only."""
