"""jcp-serve's Tinker routes as FastAPI routers, one module per group: service, training,
sampling, runs (runs, checkpoints, downloads) and futures. jcp.server.app includes them."""
