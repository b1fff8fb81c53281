"""``python -m furlong.core`` runs the ``furlong`` command."""

import sys

from .cli import main

sys.exit(main())
