"""Entry points that capture a user's model: ``accelerate()`` (accelerate.py: in place, through the Dynamo backend),
``compile_step()`` (compile_step.py: forward, backward and optimizer as one graph) and the step capture without
Dynamo that the predictor and auto batch size use (capture.py)."""
