"""Files as data: atomic writes, strict JSON, bounded reads that refuse what is not a regular file."""
