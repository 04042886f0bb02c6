"""graphtrain inside other people's training loops: the Hugging Face Trainer (integrations/hf.py)."""
