"""Checkpoints: a run's checkpoint files, megatron-core dist checkpoints (``mcore``) and conversion to and
from Hugging Face safetensors (``convert``)."""
