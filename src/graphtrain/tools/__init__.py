"""User tools over the engine: ``graphtrain.report`` (report.py), ``graphtrain.bisect`` (bisect.py, bisect_report.py),
peak memory measured in a subprocess (measure.py) and ``train.batch_size: auto`` (autobatch.py)."""
