"""What runs a captured graph: the ``graphtrain`` torch.compile backend (backend.py), the execution providers
(providers.py), ``provider: auto`` (provider_auto.py) and its background compile process (background.py)."""
