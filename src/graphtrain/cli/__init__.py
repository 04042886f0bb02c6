"""The ``graphtrain`` command line: main.py (the parser, the registry of verbs, the exit rule), train.py
(``train``), jobs.py (precompile, bisect, report), runs.py (the verbs over run folders), exits.py (the statuses)."""
