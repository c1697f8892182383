"""The jcp-train job's pieces beside its flags and loop (jcp/train.py, the `-m` entry
point): `data` (synthetic tasks, RL rollouts, --data JSONL files) and `run_files`
(checkpoints, metrics, plot)."""
