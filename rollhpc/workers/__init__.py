"""Worker roles: one file per role, heavy imports (torch, megatron, vllm) inside the classes."""
