"""What runs a captured graph: the ``graphtrain`` torch.compile backend (backend.py), the execution providers
(providers.py), ``provider: auto`` (provider_auto.py; measured.py times the candidates, tiered.py compiles Inductor in a
background process, background.py is that process) and the CPU allocator policy (allocator.py)."""
