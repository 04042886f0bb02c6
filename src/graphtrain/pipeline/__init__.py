"""The compile pipeline's stages, one plain function each (stages.py): trace to the pre-autodiff IR (trace.py), a
module as a function (functional.py), repeated blocks compiled once (blocks.py), the persistent cache (cache.py),
what is recorded per graph (state.py) and graphs' inputs as data (graph_data.py)."""
