"""``python -m gpipe.cli``: the ``gpipe`` command, as torchrun starts it."""

import sys

from gpipe.cli import main

sys.exit(main())
