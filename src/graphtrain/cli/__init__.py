"""The ``graphtrain`` command line: main.py (the parser, ``train``, the exit statuses), jobs.py (precompile, bisect,
report) and runs.py (the verbs over run folders)."""
