"""Scaling studies: the sweep's job array, its study record and the report job."""
