"""jcp-serve: the Tinker SDK 0.38 protocol over one Trainer.

wire (protobuf / JSON formats), scheduler (queue, ordering, fusion policy), state (tenants,
sessions, models, tinker:// paths on disk), app (FastAPI routes), engine (the worker thread
that owns the Trainer). Only engine imports jax (through jcp); see jcp/serve.py for the CLI.
"""
