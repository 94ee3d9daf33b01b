"""Guards: the decorators a task author writes, and what runs a task body under its permit or
its admitted start (in a pool child, an eager call or a direct call). Nothing here imports the
worker side; the decorators install the worker hooks lazily, at ``worker_init``."""
