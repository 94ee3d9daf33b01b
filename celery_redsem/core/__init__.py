"""The semaphore core: scripts, keys, permits, heartbeat and clients; usable without Celery."""
