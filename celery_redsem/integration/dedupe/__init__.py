"""De-duplication (``dedupe=``): the mark a run keeps, and the send side that takes it."""
