"""Dataset recipes (ShareGPT, HumanEval, JSONL prompts), installed as `spec_adapt.recipes`."""
