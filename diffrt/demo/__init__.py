"""The demo model's world: synthetic shape pictures, their prompts and the
classifier that judges generated pictures (``shapes``); the training script
is ``scripts/train_demo_model.py``."""
