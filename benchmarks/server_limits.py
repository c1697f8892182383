"""What the jcp-serve edge bounds save: peak memory of a zstd bomb, decompressed whole (as
before) vs streamed and stopped at --max-body-bytes (jcp.server.edge.decompress). Each case
runs in its own process so ru_maxrss is that case's peak.

    python benchmarks/server_limits.py [--mib 512]
"""

from __future__ import annotations

import argparse
import subprocess
import sys

CHILD = r"""
import resource, sys, zstandard
from jcp.server import edge

mib, mode = int(sys.argv[1]), sys.argv[2]
c = zstandard.ZstdCompressor().compressobj()
piece = bytes(1 << 20)
bomb = b"".join(c.compress(piece) for _ in range(mib)) + c.flush()
del piece
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if mode == "whole":
    out = len(zstandard.ZstdDecompressor().decompressobj().decompress(bomb))
else:
    try:
        out = len(edge.decompress(bomb, edge.Limits().body_bytes))
    except edge.Refused as e:
        out = f"HTTP {e.status}"
grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
print(f"{mode:>7}: {len(bomb):>6} B body -> {out}; peak RSS +{grew:.0f} MiB")
"""


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=512, help="decompressed size of the bomb")
    a = p.parse_args()
    for mode in ("whole", "capped"):
        subprocess.run([sys.executable, "-c", CHILD, str(a.mib), mode], check=True)


if __name__ == "__main__":
    main()
