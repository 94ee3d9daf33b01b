"""The worker side: signal hooks, the request class that frees a lost child's permit, and the
checks a worker runs as it starts."""
