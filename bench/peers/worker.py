"""One side of one engine for one round: `python worker.py ENGINE ROLE SETTINGS_JSON CELLS_FILE
[TARGET_INFO_JSON]` (ROLE: target, initiator, local or version). The driver starts the target, reads its READY line, starts the
initiator with it, collects RESULT (and the target's CHECK) lines, then closes the target's
stdin."""

from __future__ import annotations

import importlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import cells_from_json, use_hugepages  # noqa: E402


def main(argv: list[str]) -> int:
    if len(argv) < 4:
        sys.stderr.write(__doc__ + "\n")
        return 2
    module, role, settings = argv[0], argv[1], json.loads(argv[2])
    use_hugepages()  # before any buffer: the same memory as the native adapters (common.py)
    with open(argv[3]) as f:
        cells = cells_from_json(f.read())
    mod = importlib.import_module(f"engines.{module}")
    if role == "version":
        print("VERSION " + mod.version(), flush=True)
        return 0
    if role == "target":
        return mod.target(settings, cells) or 0
    if role == "local":  # one command runs both sides (ceilings, mpirun)
        return mod.local(settings, cells)
    if role == "initiator":
        return mod.initiator(settings, cells, json.loads(argv[4]))
    sys.stderr.write(f"worker: unknown role {role}\n")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
