"""The starting policy a run builds when its model_dir is absent: a tiny Qwen2 model and its tokenizer (tiny), fine-tuned
on a task until it sometimes succeeds (sft), for RLVR (policy_prep) or on expert episodes of an environment
(agentic_prep). Apart from the model definitions (models/), which training uses."""
