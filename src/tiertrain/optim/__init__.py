"""CPU optimizer for tiered training: per-block AdamW on chunks, run on worker threads."""
