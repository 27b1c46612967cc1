"""What the machine offers: which cores the workers and the trainer run on (``cores.py``) and which precisions a
device computes natively (``precision.py``)."""
