"""``python -m benchmarks.celery_e2e``: see :mod:`benchmarks.celery_e2e.harness`."""

import sys

from benchmarks.celery_e2e.harness import main

sys.exit(main())
