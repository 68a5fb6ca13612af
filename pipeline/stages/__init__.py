"""Pipeline stages built from config: resume, train, rotate-last-N, best-val, final."""
