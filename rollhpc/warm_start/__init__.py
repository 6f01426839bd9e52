"""The starting policy a run builds when its model_dir is absent: a tiny Qwen2 model and its
tokenizer (tiny), fine-tuned on a task until it sometimes succeeds (sft), for RLVR (policy_prep) or
on expert episodes of an environment (agentic_prep, agentic_episodes). Apart from the model
definitions (models/), which training uses.

What a config names is light (sft_config, tiny_config, policy_prep, agentic_prep, agentic_episodes):
a config loads without torch or transformers. What builds the policy is heavy and imported only when
a directory is built
(policy_build, agentic_build, agentic_play, sft, tiny)."""
