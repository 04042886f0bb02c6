"""The bottom floor: what a user and the environment give. Typed config sections (sections.py) and their schema
(schema.py), job files (jobfile.py), the fallback policy (fallback.py), the torch versions supported
(torch_range.py, read without importing torch) and the shims for their API differences (torch_compat.py)."""
