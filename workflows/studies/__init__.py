"""Scaling studies: the sweep's point jobs, its study record and the report job."""
