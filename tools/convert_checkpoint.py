#!/usr/bin/env python
"""Checkpoint conversion Hugging Face <-> megatron-core, the same as ``rollhpc convert``.

python tools/convert_checkpoint.py hf-to-mcore SRC DST [--tp N] [--pp N] [--ep N] [--verify]
python tools/convert_checkpoint.py mcore-to-hf SRC DST [--max-shard-size 5GB] [--verify]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollhpc.conversion import convert_cli  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="convert_checkpoint.py", description=__doc__.splitlines()[0]
    )
    convert_cli.add_arguments(parser)
    return convert_cli.run(parser.parse_args(argv))


if __name__ == "__main__":  # the conversion's worker processes need this guard
    sys.exit(main())
