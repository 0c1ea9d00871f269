"""``python -m tiertrain.bench memory ...`` is ``tiertrain bench memory ...``."""

import sys

from tiertrain.cli.main import main

sys.exit(main(["bench", *sys.argv[1:]]))
