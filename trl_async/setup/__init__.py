"""What the trainer wires before training, in order: ``trainer_view.py`` reads what GRPOTrainer set up (the one
place that reads trainer attributes for the layers below), ``checks.py`` refuses what cannot work, ``pool.py``
builds the rollout pool from what it is handed."""
