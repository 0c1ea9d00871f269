"""``python -m tiertrain ...`` (and ``torchrun ... -m tiertrain train ...``) is the ``tiertrain`` command."""

import sys

from tiertrain.cli.main import main

sys.exit(main())
