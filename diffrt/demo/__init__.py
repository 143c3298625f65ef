"""The demo models' worlds: synthetic shape pictures, their prompts and the
classifier that judges generated pictures (``shapes``; trained by
``scripts/train_demo_model.py``), and the same for clips of one moving shape
(``motion``; ``scripts/train_motion_model.py``)."""
