"""Harnesses the test modules share (no test module imports another test module):

- hf_models: the one tiny Hugging Face model builder (sizes as arguments) and the one
  randomiser of a peft model's LoRA factors.
- model_harness: the model under shard_map against transformers (sizes, meshes, batches).
- trainer_harness: Trainer tests' config, data, PEFT folders, cached Trainers.
- loss_harness: loss tests' data and NumPy formulas.
- moe_harness: the tiny Qwen3-MoE reference and its random expert adapters.
- mp_case / mp_worker, ckpt_kill_child: code run in child processes.
"""
