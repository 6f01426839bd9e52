"""Checkpoints: a run's checkpoint files (``storage``, ``run_checkpoint``, ``run_state``), a trainer role's share
of them (``trainer_state``, named by ``role_files``), megatron-core dist checkpoints (``mcore``; their metadata
and files, read without torch: ``mcore_files``) and what ``rollhpc ckpt`` prints (``report``)."""
