"""``python -m benchmarks.core``: see :mod:`benchmarks.core.bench`."""

import sys

from benchmarks.core.bench import main

sys.exit(main())
