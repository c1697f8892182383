"""The bounds every custom loss is held to: graph size (nodes, inputs, depth, literals), the
Python values a graph computes (int64, sequence lengths), array sizes, and the time and traced
operations one request may spend. Constants only; the graph checks (graph.py, cost.py) and the
bounded program (program.py) enforce them.
"""

from __future__ import annotations

import re

MAX_NODES = 4096
MAX_INPUTS = 16  # logprobs included, as the SDK's tracer allows
MAX_DEPTH = 512
MAX_LITERAL = 1024  # entries of one encoded argument (lists, tuples, dicts)
MAX_LITERALS = 1 << 16  # entries of all of a graph's encoded arguments together
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1  # every Python int a graph holds
MAX_SEQUENCE = 64  # entries of a tuple or list a graph builds (shapes, concatenations)
MAX_ELEMENTS = 1 << 24  # elements of one node's array (a dimension is at most this too)
MAX_DATUM_ELEMENTS = 1 << 29  # elements of all of one datum's intermediate arrays
# A dimension, and so any shape-derived int, is below 2**SHAPE_BITS.
SHAPE_BITS = MAX_ELEMENTS.bit_length()
# Seconds of graph evaluation (shapes) while one request's datums are checked, and graph
# operations one request may trace into its step (the loss is traced once per datum); at
# about 50 µs per traced operation the two agree.
CHECK_BUDGET_S = 5.0
MAX_TRACED_OPS = 1 << 16
METRIC_KEY = re.compile(r"custom/[a-z0-9_./-]{1,64}:(sum|mean)")
INPUT_NAME = re.compile(r"[a-z_][a-z0-9_]{0,63}")
