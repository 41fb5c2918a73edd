"""``python -m specdec_ext``: the ``specdec`` command line."""
import sys

from .cli import main

sys.exit(main())
