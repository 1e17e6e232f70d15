"""``python -m gpipe.cli``: the ``gpipe`` command, as torchrun starts it."""

import sys

from . import main

sys.exit(main())
