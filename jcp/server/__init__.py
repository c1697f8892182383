"""jcp-serve: the Tinker SDK 0.38 protocol (and OpenAI routes) over one Trainer.

The HTTP side (never jax): app + routes/ (FastAPI routers over context.AppContext), asgi
(hot routes), edge (typed bodies, bounds), wire (protobuf / JSON), future_table, state
(+ run_index, run_listing: tenants, sessions, models, tinker:// paths on disk), scheduler
(order, fusion, fairness), openai_api / openai_params / openai_format, checkpoint_api, text,
redact. The owner side: worker (the thread that owns the Trainer; its parts slots,
model_ops, passes), replica (multi-process jobs) and priority (the compute threads' nice
value). service assembles them; see
jcp/serve.py for the CLI. docs/architecture.md draws the map.
"""
