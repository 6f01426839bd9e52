"""Models: the policy networks and how they are built (tiny local Hugging Face checkpoints, Megatron GPT)."""
