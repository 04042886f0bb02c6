"""Graph passes. Each module registers its passes with `manager.register_pass`; see manager.py."""

from graphtrain.passes.manager import PassContext, PassRecord, pipeline, register_pass, registered_passes, run_pipeline

__all__ = ["PassContext", "PassRecord", "pipeline", "register_pass", "registered_passes", "run_pipeline"]
